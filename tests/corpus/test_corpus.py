"""Others' training programs (``corpus/``) through recipecache: each one's smallest configuration, 2 ranks on gloo.

Each program was written against a framework's own API (Lightning, Accelerate, HF's Trainer and
``generate``, torchvision, torch_geometric, diffusers, FSDP2 + TP), not for this repository: the
defects our own benchmarks missed showed up there. Per program, four jobs on one filesystem store,
every job's ranks on new empty torch caches (as on new nodes):

1. ``store-cold``: the graph store on an empty store: it compiles, and the ranks share compiles;
2. ``store-fresh``: the graph store again: it must compile nothing;
3. ``precompile-cold``: ``--precompile`` on that store: the tier builds its artifacts (the graphs
   themselves come from the store);
4. ``precompile-fresh``: ``--precompile`` again: it must compile nothing, and no artifact may fail
   to load (``load_failed``: Lightning's artifacts did, the parameters' gradients in their guards).

Every job's losses must equal the first job's bit for bit (same kernels, same data). What the tier
cannot serve may fall back to the normal path, counted with a named detail, never a failed load.
Plain torchrun's losses, timings and the other modes are the benchmark's (``benchmarks/corpus_bench.py``), and
so is torchvision at two image sizes (its fresh graph-store job compiled until a fresh process replayed the cold
job's static first trace: ``docs/design.md``); here it trains at one size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.paths import REPO

sys.path.insert(0, str(REPO / "corpus"))
from jobs import PROGRAMS, Job, run_job  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(3000)]

#: the jobs, in order: (tag, mode)
JOBS = (
    ("store-cold", "store"),
    ("store-fresh", "store"),
    ("precompile-cold", "precompile"),
    ("precompile-fresh", "precompile"),
)
#: fallback details that mean the tier broke, not that torch cannot serve a function; every job runs the same code
#: with the same values, so an artifact another process built that this one calls other code (torch_geometric's
#: propagate, generated into each process's temporary directory) or other values broke too; so did guards that
#: reject what a key's artifacts serve (HF's growing KV cache: the key's next guard variant serves it)
BROKEN = {"load_failed", "precompile_failed", "bad_artifact", "source_changed", "value_changed", "guard_failed"}


def run_all(name: str, tmp_path: Path, order: tuple[tuple[str, str], ...] = JOBS) -> dict[str, Job]:
    """``order``'s jobs of program ``name`` ((tag, mode) each), one after the other on one store, each ending 0."""
    program = PROGRAMS[name]
    jobs: dict[str, Job] = {}
    for tag, mode in order:
        job = run_job(program, mode, work=tmp_path, dirs=tmp_path / f"{tag}-dirs", store=tmp_path / "store", tag=tag)
        assert job.exit_code == 0, job.describe()
        assert len(job.ranks) == program.nproc, f"{tag}: ranks wrote {len(job.ranks)} records\n{job.output}"
        jobs[tag] = job
    return jobs


@pytest.mark.parametrize("name", [n for n in PROGRAMS if PROGRAMS[n].nproc == 2])
def test_a_program_cold_then_fresh_on_the_graph_store_and_the_tier(name: str, tmp_path: Path) -> None:
    jobs = run_all(name, tmp_path)
    cold = jobs["store-cold"]
    assert cold.compiles, f"the cold job compiled nothing: {cold.report}"
    assert all(losses for losses in cold.losses), cold.losses
    for tag in ("store-fresh", "precompile-fresh"):
        assert jobs[tag].compiles == 0, f"{tag} compiled {jobs[tag].compiles}: {jobs[tag].report}"
    for tag in ("precompile-cold", "precompile-fresh"):
        broken = {d: n for d, n in jobs[tag].precompile_fallbacks.items() if d in BROKEN}
        assert not broken, f"{tag}: {broken}\n" + "\n".join(jobs[tag].fallback_details)
    for tag, job in jobs.items():
        assert job.losses == cold.losses, f"{tag}'s losses differ from store-cold's"


def test_precompile_and_no_stall_together_build_the_tier_for_the_next_job(tmp_path: Path) -> None:
    """``--precompile --no-stall`` (the benchmark's ``both``): the tier's builds compiled their graphs through
    no-stall, whose stand-in torch's ``aot_compile`` cannot bundle, so every function failed to precompile
    (``precompile_failed``, "expected OutputCode") and no fresh job ever loaded a precompiled artifact. A build
    compiles its graphs itself now; the next job loads the tier's artifacts and compiles nothing."""
    jobs = run_all("accelerate_lm", tmp_path, (("both-cold", "both"), ("both-fresh", "both")))
    for tag, job in jobs.items():
        broken = {d: n for d, n in job.precompile_fallbacks.items() if d in BROKEN}
        assert not broken, f"{tag}: {broken}\n" + "\n".join(job.fallback_details)
    fresh = jobs["both-fresh"]
    assert fresh.compiles == 0 and not fresh.report["no_stall"], fresh.report
    assert all(m["lookups"]["precompiled"]["hit"] > 0 for m in fresh.metrics), [m["lookups"] for m in fresh.metrics]
