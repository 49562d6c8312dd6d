"""What recording key components costs a rank: time per graph key and bytes on disk.

The torch integration records, for every graph key it looks up in the store, the
components torch hashed into it (``recipecache.runs.keyinfo.KeyLog``), so ``recipecache explain``
works after the job. This script captures the hash details of a real compile (one
torch.compile of a small MLP step, forward and backward), then records them under many
distinct keys and prints the median microseconds per key, the bytes per key record and
the one-off bytes of the environment record, beside the compile seconds they ride on.

    python benchmarks/keylog_bench.py [--keys 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def capture_details() -> tuple[list[list[str]], float]:
    """Hash-detail lines of the graphs of one small compile, and the compile's seconds."""
    import torch
    from torch._inductor import codecache

    captured: list[list[str]] = []
    original = codecache.compiled_fx_graph_hash

    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        key, details = original(*args, **kwargs)
        captured.append(list(details))
        return key, details

    codecache.compiled_fx_graph_hash = wrapped
    try:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        start = time.perf_counter()
        torch.compile(model)(torch.randn(8, 32)).sum().backward()
        seconds = time.perf_counter() - start
    finally:
        codecache.compiled_fx_graph_hash = original
    return captured, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        import os

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        details, compile_s = capture_details()
        from recipecache.keylog import KeyLog

        per_key_us = []
        for repeat in range(args.repeats):
            directory = Path(tmp) / f"keys{repeat}"
            log = KeyLog(directory, rank=0)
            start = time.perf_counter()
            for i in range(args.keys):
                log.record(f"torch1:pt2:fx-graph-v1::f{repeat:02d}{i:06d}:c1", details[i % len(details)],
                           name="Sequential.forward", shapes="f32[8,32] f32[64,32]", context={"host": "h"})
            per_key_us.append((time.perf_counter() - start) / args.keys * 1e6)
            log.close()
        lines = next(directory.glob("*.jsonl")).read_bytes().splitlines()
    env_bytes = len(lines[0])
    key_bytes = statistics.median(len(line) for line in lines[1:])
    print(f"graphs in the sample compile: {len(details)}, components per key: {len(details[0])}, "
          f"compile {compile_s:.1f} s")
    print(f"record one key: median {statistics.median(per_key_us):.0f} us over {args.repeats} runs of {args.keys} keys "
          f"(runs: {', '.join(f'{u:.0f}' for u in per_key_us)})")
    print(f"bytes: environment record {env_bytes} (once per process), key record median {key_bytes:.0f}")
    print(f"ratio record/compile per graph: {statistics.median(per_key_us) / 1e6 / (compile_s / len(details)):.2e}")


if __name__ == "__main__":
    main()
