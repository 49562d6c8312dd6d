"""HF Transformers: ``Trainer(torch_compile=True)`` fine-tuning a GPT-2 built from a tiny config, two sequence lengths.

No weights are downloaded: the model is ``GPT2LMHeadModel(GPT2Config(...))`` with a few small
layers. The dataset's examples come in two lengths and the collator does not pad across them, so
the compiled model meets two shapes. Launched by torchrun (the Trainer runs DDP over gloo on CPU).
"""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from _common import Record, generator, parser, sizes

VOCAB = 128


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Arithmetic token sequences, read in order: each step's batches (one per rank) share one length, and the
    steps cycle through the lengths."""

    def __init__(self, count: int, lengths: list[int], step_examples: int) -> None:
        self.count, self.lengths, self.step_examples = count, lengths, step_examples

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = generator(i, salt=7)
        length = self.lengths[(i // self.step_examples) % len(self.lengths)]
        start, stride = int(torch.randint(0, VOCAB, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
        ids = (start + stride * torch.arange(length)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


class Losses(TrainerCallback):
    """Every logged training loss (``logging_steps=1``: one per step), timed from the start of training."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.record.start()

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.record.step(logs["loss"])


def main() -> None:
    args = parser(__doc__, steps=4, lengths="16,32").parse_args()
    batch = 2
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    record = Record(args.out)
    losses = Losses(record)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=batch,
            max_steps=args.steps,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            ddp_backend="gloo",
            torch_compile=True,
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
            train_sampling_strategy="sequential",
        )
        step_examples = batch * training.world_size
        dataset = Sequences(args.steps * step_examples, sizes(args.lengths), step_examples)
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[losses])
        trainer.train()
    record.write()


if __name__ == "__main__":
    main()
