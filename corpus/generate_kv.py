"""HF Transformers ``generate``: greedy decoding with a compiled GPT-2 forward and a growing KV cache.

Inference, not training: each new token appends to the dynamic KV cache, so every decoding step
calls the compiled forward with a longer cache (torch marks the length dynamic after the first
change), and prompts of two lengths make the prefill meet two shapes. No weights are downloaded:
GPT-2 from a tiny config, seeded. Each rank decodes its own prompts (data-parallel inference); its
"losses" are the generated token ids, which must match plain torchrun's exactly. Launched by torchrun.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from _common import Record, generator, parser, sizes

VOCAB = 128


def main() -> None:
    args = parser(__doc__, steps=2, lengths="6,10").parse_args()
    prompt_lengths = sizes(args.lengths)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    model.forward = torch.compile(model.forward)
    record = Record(args.out)
    record.start()
    with torch.no_grad():
        for step in range(args.steps):
            length = prompt_lengths[step % len(prompt_lengths)]
            prompt = torch.randint(0, VOCAB, (1, length), generator=generator(step))
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
            )
            for token in out[0, length:].tolist():  # one 'loss' per token: the ids must match exactly
                record.step(float(token))
    record.write()


if __name__ == "__main__":
    main()
