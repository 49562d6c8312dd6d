"""Ranks of a cold job probe the CPU at the same moment, on a CPU with one vector ISA to probe.

usage (under recipecache-run, 2 ranks, --rank-dirs): isa_probe_ranks.py OUT_DIR

torch probes the CPU's vector ISAs (a g++ build of a test file per ISA) the first time a
process compiles. On a CPU with one ISA to probe (AVX2 without AVX-512, a Zen 3), every
rank of a cold job starts with that same probe, at the same time. Each rank here
restricts torch's view of the CPU to AVX2 (the CPU has it; the ISAs it drops are never
used, and nothing is compiled), meets the others at a barrier, asks torch for the valid
ISAs, and writes what it found and its store lookups of probe libraries to
``OUT_DIR/rank<R>.json`` (files, not an object collective: see docs/torch-integration-notes.md, "Traps").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch._inductor import cpu_vec_isa

from recipecache.torch_integration import metrics


def main() -> None:
    out = Path(sys.argv[1])
    assert "avx2" in cpu_vec_isa.x86_isa_checker(), "the test checks for AVX2 before it starts the job"
    cpu_vec_isa.x86_isa_checker = lambda: ["avx2"]  # what torch sees on an AVX2-only CPU
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    report = {"valid": valid, "isa": metrics()["lookups"]["isa"], "fallbacks": metrics()["fallbacks"]}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
