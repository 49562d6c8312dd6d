"""The precompiled tier (``enable(precompile=True)``) with real torch.compile on CPU.

Every compile scenario is a fresh process (tests/workers/precompile_worker.py) with its
own empty TORCHINDUCTOR_CACHE_DIR and TMPDIR and the g++ wrapper of the torch
integration tests, so a "hit" means no tracing (dynamo's frame counter at 0) and no
compiler run. The model lives in a source file the test writes, so one scenario can
change it. Cold processes run side by side in one fixture, the processes that read
their store side by side in another:

* cold: empty store; precompiles the model and learns that ``broken`` has a graph
  break; plain: torch alone, the reference results;
* hit: fresh dirs on that store; loads the model; then the model's ``offset`` tensor
  (guarded, not in the key) gets a new shape, outside the artifact's guards: precompiled
  as the key's next guard variant; ``broken`` (its verdict) falls back to the normal path;
* again: a fresh process on the store the hit process left: loads both guard variants;
* changed: the model file changed (its output doubled): a miss, compiled afresh;
* corrupt: the model's artifact has a flipped byte: refused, normal path.

The last test runs two 2-rank torchrun jobs (gloo) of examples/train.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

import recipecache
from recipecache.runs.events import read_events
from recipecache.keys import storage_key
from recipecache.torch_integration.artifact import ArtifactError
from recipecache.torch_integration.precompiled.dispatcher import KEY_KIND
from recipecache.torch_integration.precompiled.compiled_function import Pin, Precompiled, SourceFile

from support.torch_flags import compile_on_one_rank
from test_torch_integration import base  # noqa: F401 - the module's temp dir with the logging g++ first on PATH
from harness.paths import REPO, WORKERS

pytestmark = pytest.mark.torch

WORKER = WORKERS / "precompile_worker.py"
VERSION_WORKER = WORKERS / "precompile_version.py"
NAMESPACE = "precompiletest"
SECRET = "precompile-test-secret"
MODEL_SOURCE = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

        self.offset = torch.zeros(4)  # a plain attribute: its shape is guarded, not in the key

    def forward(self, x):
        return (self.fc2(torch.relu(self.fc1(x))) + self.offset){scale}


def broken(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2
'''


@dataclass
class Run:
    dir: Path
    report: dict[str, Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.report["metrics"]

    @property
    def precompiled(self) -> dict[str, int]:
        return self.metrics["lookups"]["precompiled"]


def _model_dir(base: Path, name: str, scale: str = "") -> Path:
    directory = base / name
    directory.mkdir()
    (directory / "pc_model.py").write_text(MODEL_SOURCE.format(scale=scale))
    return directory


def _start(base: Path, name: str, mode: str, model_dir: Path, *args: str,
           store: Path | None = None, worker: Path = WORKER) -> tuple[subprocess.Popen[str], Path]:
    run_dir = base / name
    for sub in ("cache", "tmp"):
        (run_dir / sub).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(PATH=f"{base / 'bin'}{os.pathsep}{env['PATH']}", GXX_LOG=str(run_dir / "gxx.log"),
               TORCHINDUCTOR_CACHE_DIR=str(run_dir / "cache"), TMPDIR=str(run_dir / "tmp"), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0")
    if store is not None:
        env.update(RECIPECACHE_URL=f"file://{store}", RECIPECACHE_NAMESPACE=NAMESPACE, RECIPECACHE_SECRET=SECRET,
                   RECIPECACHE_EVENT_LOG=str(run_dir / "events"))
    proc = subprocess.Popen([sys.executable, str(worker), str(run_dir / "out.json"), mode, str(model_dir), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run_dir


def _finish(started: tuple[subprocess.Popen[str], Path]) -> Run:
    proc, run_dir = started
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-4000:]
    return Run(run_dir, json.loads((run_dir / "out.json").read_text()))


@dataclass
class Cold:
    store: Path
    model_dir: Path
    cold: Run
    plain: Run


@dataclass
class Followups:
    hit: Run
    again: Run
    changed: Run
    corrupt: Run


@pytest.fixture(scope="module")
def cold(base: Path) -> Cold:
    model_dir = _model_dir(base, "model")
    store = base / "store"
    started = [_start(base, "cold", "rc", model_dir, "--broken", store=store),
               _start(base, "plain", "plain", model_dir, "--offset-size", "1", "--broken")]
    cold_run, plain = (_finish(s) for s in started)
    return Cold(store, model_dir, cold_run, plain)


def _corrupt_model_artifact(store: Path, cold_run: Run) -> None:
    """Flip the last byte of the model's precompiled artifact (the first one the cold process published; its
    build published the model's graphs before it)."""
    key = next(e["key"] for e in read_events(cold_run.dir / "events")
               if e["event"] == "put" and f":{KEY_KIND}" in e["key"])
    backend = recipecache.open_store(f"file://{store}", namespace=NAMESPACE, secret=SECRET).backend
    blob = bytearray(backend.get(storage_key(NAMESPACE, key)))
    blob[-1] ^= 1
    backend.put(storage_key(NAMESPACE, key), bytes(blob))


@pytest.fixture(scope="module")
def followups(cold: Cold, base: Path) -> Followups:
    changed_store, corrupt_store = base / "changed-store", base / "corrupt-store"
    shutil.copytree(cold.store, changed_store)
    shutil.copytree(cold.store, corrupt_store)
    _corrupt_model_artifact(corrupt_store, cold.cold)
    started = [
        _start(base, "hit", "rc", cold.model_dir, "--offset-size", "1", "--broken", store=cold.store),
        _start(base, "corrupt", "rc", cold.model_dir, store=corrupt_store),
    ]
    hit, corrupt = (_finish(s) for s in started)
    again = _finish(_start(base, "again", "rc", cold.model_dir, "--offset-size", "1", store=cold.store))
    # then the model file changes under the same path (the key names the path, the artifact its content)
    (cold.model_dir / "pc_model.py").write_text(MODEL_SOURCE.format(scale=" * 2"))
    changed = _finish(_start(base, "changed", "rc", cold.model_dir, store=changed_store))
    return Followups(hit, again, changed, corrupt)


# -- the hit path ---------------------------------------------------------------------------
@pytest.mark.internals
def test_cold_process_precompiles_and_matches_the_normal_path(cold: Cold) -> None:
    run = cold.cold
    assert run.precompiled == {"hit": 0, "miss": 2, "put": 2}, "the model, and broken's graph-break verdict"
    assert run.metrics["precompile_fallbacks"] == {"graph_break": 1}
    assert run.metrics["fallbacks"] == {"precompile_fallback": 1}
    assert run.report["model_digest"] == cold.plain.report["model_digest"], "outputs and gradients bitwise equal"
    assert run.metrics["kernels"]["shipped"] > 0, "the kernels travel with the artifact"
    assert run.report["broken"] == cold.plain.report["broken"]


@pytest.mark.internals
def test_fresh_process_loads_without_tracing_or_compiling(cold: Cold, followups: Followups) -> None:
    hit = followups.hit
    assert hit.report["model_frames"] == 0, "dynamo traced nothing for the model"
    assert hit.report["model_compiler_runs"] == 0
    assert cold.plain.report["model_frames"] > 0, "torch alone does trace: the counter means something"
    assert hit.report["model_digest"] == cold.plain.report["model_digest"]
    assert hit.metrics["saved_s"] > 0


# -- fallbacks ----------------------------------------------------------------------------------
@pytest.mark.internals
def test_a_shape_outside_the_guards_is_precompiled_as_the_keys_next_guard_variant(
    cold: Cold, followups: Followups
) -> None:
    """An input the key does not hold (a tensor attribute's shape) changes: the loaded artifact's guards reject the
    call, and the tier looks up (here: precompiles and publishes) the key's next guard variant, as torch recompiles,
    instead of sending the call to the normal path. A fresh process then loads both, tracing nothing."""
    hit, again = followups.hit, followups.again
    assert "guard_failed" not in hit.metrics["precompile_fallbacks"]
    assert hit.metrics["precompile_shapes"] == {"static_per_shape": 2}, "the model's artifact and its guard variant"
    assert hit.report["offset_digest"] == cold.plain.report["offset_digest"]
    assert again.precompiled == {"hit": 2, "miss": 0, "put": 0}, "the key and its guard variant, both loaded"
    assert again.metrics["precompile_fallbacks"] == {}
    assert again.report["model_frames"] == 0 and again.report["offset_frames"] == 0, "dynamo traced nothing"
    assert again.report["offset_digest"] == cold.plain.report["offset_digest"]


@pytest.mark.internals
def test_a_graph_break_falls_back_and_the_verdict_is_shared(cold: Cold, followups: Followups) -> None:
    hit = followups.hit
    assert hit.metrics["precompile_fallbacks"] == {"graph_break": 1}
    assert hit.metrics["fallbacks"]["precompile_fallback"] == 1
    # the model's artifact (a hit), its new guard variant (a miss, precompiled: the one put) and broken's verdict
    # (read, not relearned: a hit the tier does not use counts as a miss)
    assert hit.precompiled == {"hit": 1, "miss": 2, "put": 1}
    assert hit.report["broken"] == cold.plain.report["broken"]


@pytest.mark.internals
def test_a_changed_source_file_is_a_miss_not_a_stale_load(followups: Followups) -> None:
    changed = followups.changed
    assert changed.metrics["stale_sources"] == 1
    assert changed.precompiled == {"hit": 0, "miss": 1, "put": 1}
    # the new source doubles the output: loading the old artifact would be off by the output itself
    assert changed.report["max_diff_vs_eager"] < 1e-5


@pytest.mark.internals
def test_a_corrupted_artifact_is_refused_and_falls_back(cold: Cold, followups: Followups) -> None:
    corrupt = followups.corrupt
    assert corrupt.metrics["store"]["misses_by_reason"]["corrupt"] == 1 and corrupt.metrics["refused"] == 1
    assert corrupt.metrics["precompile_fallbacks"] == {"corrupt": 1}
    assert corrupt.report["model_frames"] > 0, "the normal path traced it"
    assert corrupt.report["model_digest"] == cold.plain.report["model_digest"]


# -- the code a process runs, not the file on disk ---------------------------------------------
VERSION_SOURCE = """import torch


def f(x):
    return helper(x).sum()


def helper(x):
    return x {op}
"""


@pytest.mark.internals
def test_a_process_runs_the_code_it_imported_when_the_file_changed_since(base: Path) -> None:
    """Issue 18 item 5: a long job imported v1; the checkout then became v2 and another job published v2.

    The long job must run its own v1 (1 + 2 = 3 per element): not load v2's artifact (1 - 5 = -4) for a
    signature v2 published, and not publish its v1 compile under v2's name for one it compiles itself,
    which a fresh v2 process would then load.
    """
    model_dir = base / "versions"
    model_dir.mkdir()
    source = model_dir / "pv_model.py"
    source.write_text(VERSION_SOURCE.format(op="+ 2"))
    store, go = base / "versions-store", base / "versions-go"
    started = _start(base, "v1-long-job", "rc", model_dir, "1,2", "--go", str(go), store=store, worker=VERSION_WORKER)
    proc, run_dir = started
    while not (run_dir / "out.ready").exists():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.1)
    source.write_text(VERSION_SOURCE.format(op="- 5"))
    v2 = _finish(_start(base, "v2-job", "rc", model_dir, "1", store=store, worker=VERSION_WORKER))
    assert v2.report["results"] == [-4.0] and v2.precompiled["put"] == 1
    go.touch()
    v1 = _finish(started)
    assert v1.report["results"] == [3.0, 6.0], "the long job ran its own code"
    assert v1.metrics["stale_sources"] == 1, "v2's artifact was seen and refused"
    assert v1.precompiled == {"hit": 0, "miss": 2, "put": 2}
    fresh = _finish(_start(base, "v2-fresh", "rc", model_dir, "1,2", store=store, worker=VERSION_WORKER))
    assert fresh.report["results"] == [-4.0, -8.0], "v1's artifacts are not taken for v2's"
    assert fresh.metrics["stale_sources"] == 2
    assert fresh.precompiled == {"hit": 1, "miss": 1, "put": 1}, "v2's own artifact is found under its version"


LAZY_MODEL = """import torch

import pv_lazy_pkg


def f(x):
    import pv_lazy_inner  # imported at the first call, as models often do

    return pv_lazy_pkg.scale(pv_lazy_inner.helper(x)).sum()
"""
#: a package whose names come from a submodule imported at first access (module ``__getattr__``, as transformers)
LAZY_PACKAGE = """import importlib


def __getattr__(name):
    return getattr(importlib.import_module(".impl", __name__), name)
"""


@pytest.mark.internals
def test_a_model_that_imports_lazily_is_served_in_a_fresh_process(base: Path) -> None:
    """Issue 44 item 5: the files dynamo traces include modules the model imports at its first call (an ``import``
    in a function body, a package's module ``__getattr__``). A fresh process checks the artifact before that call,
    holds no module of those files yet, and every one fell back with ``source_changed``. Such a file is now
    imported by the name that loads it from that very path before its digest is taken (what the call is about
    to do), so the same code hits; and edited code still misses."""
    model_dir = base / "lazy"
    (model_dir / "pv_lazy_pkg").mkdir(parents=True)
    (model_dir / "pv_model.py").write_text(LAZY_MODEL)
    (model_dir / "pv_lazy_inner.py").write_text("def helper(x):\n    return x + 2\n")
    (model_dir / "pv_lazy_pkg" / "__init__.py").write_text(LAZY_PACKAGE)
    (model_dir / "pv_lazy_pkg" / "impl.py").write_text("def scale(x):\n    return x * 3\n")
    store = base / "lazy-store"
    cold = _finish(_start(base, "lazy-cold", "rc", model_dir, "2", store=store, worker=VERSION_WORKER))
    assert cold.report["results"] == [18.0] and cold.precompiled["put"] == 1
    fresh = _finish(_start(base, "lazy-fresh", "rc", model_dir, "2", store=store, worker=VERSION_WORKER))
    assert fresh.report["results"] == [18.0]
    assert fresh.metrics["stale_sources"] == 0 and fresh.precompiled == {"hit": 1, "miss": 0, "put": 0}
    (model_dir / "pv_lazy_pkg" / "impl.py").write_text("def scale(x):\n    return x * 5\n")
    edited = _finish(_start(base, "lazy-edited", "rc", model_dir, "2", store=store, worker=VERSION_WORKER))
    assert edited.report["results"] == [30.0], "the edited lazily imported code runs, not the artifact"
    assert edited.precompiled["hit"] == 0 and edited.precompiled["put"] == 1


# -- values the traced code reads that are not in its code ----------------------------------------
VALUES_WORKER = WORKERS / "precompile_values.py"
VALUES_CFG = """SCALE = 100.0


class Consts:
    FACTOR = 1000.0
"""
VALUES_SOURCE = """import pvals_cfg as cfg
from pvals_cfg import Consts

SHIFT = 10.0


def f(x, k={default}):
    return x * k + SHIFT + cfg.SCALE + Consts.FACTOR


def make(cell):
    def g(x):
        return x * 2 + cell
    return g
"""


@pytest.mark.internals
def test_values_outside_the_code_object_are_checked_not_served_stale(base: Path) -> None:
    """Issue 34: a process whose own values differ from the producer's never runs the producer's.

    ``f`` reads a default argument, its module's global, another module's attribute and a class
    attribute of a class from another module, ``g`` a closure cell (each a distinct power of ten in the
    result). torch's ``aot_compile`` drops the guards on globals, takes a module's or class's attribute
    guard's expected value from the loader's own value, and binds the producer's defaults and closure:
    each changed value was served as the producer's. Each must be a counted ``value_changed`` fallback
    that computes what eager computes; a global changed between two calls too (torch would recompile).
    """
    model_dir = base / "values"
    model_dir.mkdir()
    (model_dir / "pvals_cfg.py").write_text(VALUES_CFG)
    (model_dir / "pvals_model.py").write_text(VALUES_SOURCE.format(default="2.0"))
    store = base / "values-store"
    cold = _finish(_start(base, "values-cold", "rc", model_dir, "publish", store=store, worker=VALUES_WORKER))
    assert [(cold.report[n]["result"], cold.report[n]["eager"]) for n in ("publish_f", "publish_g")] == [
        (1112.0, 1112.0), (10002.0, 10002.0)]
    assert cold.precompiled["put"] == 2
    # the default is edited: the value lives in the module's code object, which no traced code is
    (model_dir / "pvals_model.py").write_text(VALUES_SOURCE.format(default="3.0"))
    changed = _finish(_start(base, "values-changed", "rc", model_dir, "change", store=store, worker=VALUES_WORKER))
    cases = ("default", "module_attribute", "class_attribute", "closure_cell", "runtime")
    results = {name: (changed.report[name]["result"], changed.report[name]["eager"]) for name in cases}
    assert results == {"default": (1113.0, 1113.0), "module_attribute": (1212.0, 1212.0),
                       "class_attribute": (2112.0, 2112.0), "closure_cell": (20002.0, 20002.0),
                       "runtime": (1122.0, 1122.0)}, "each process runs its own values"
    assert [changed.report[name]["fallbacks"].get("value_changed", 0) for name in cases] == [1, 2, 3, 4, 5]
    assert changed.report["runtime"]["loaded"] == 1112.0, "the producer's values again: the artifact serves"
    assert changed.metrics["stale_sources"] == 0, "the code is the producer's: only values differ"
    assert changed.precompiled["hit"] == 1 and changed.precompiled["put"] == 0


# -- two ranks --------------------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.timeout(1500)
def test_two_rank_job_one_rank_precompiles_and_the_other_loads(tmp_path: Path) -> None:
    """examples/train.py: rank r meets bucket length r first, so each rank precompiles one length.

    With --prewarm every rank then runs both lengths: the one the other rank compiled is
    loaded, and training meets no compile. A second job of fresh ranks (empty local dirs)
    on the filled store compiles nothing and gives the same losses.
    """
    from test_multirank import ranks, run_cached

    store = f"file://{tmp_path / 'store'}"
    cold = run_cached(tmp_path, "cold", store, "--precompile", "--prewarm")
    warm = run_cached(tmp_path, "warm", store, "--precompile")
    # the precompiled artifacts (each build also publishes the graphs it compiled, issue 33)
    compiled = {rank: {key for key in cold.keys("put", rank) if f":{KEY_KIND}" in key} for rank in (0, 1)}
    assert all(len(keys) == 1 for keys in compiled.values()) and compiled[0] != compiled[1]
    for rank in (0, 1):
        assert compiled[1 - rank] <= cold.keys("hit", rank), f"rank {rank} loaded what the other precompiled"
    assert all(r["compiles"] == 0 for r in cold.output["in_training"])
    for row in ranks(warm):
        assert (row["compiles"], row["hits"], row["fallbacks"]) == (0, 2, {}), row
    assert warm.losses == cold.losses


LENGTHS_WORKER = WORKERS / "precompile_lengths.py"


def _lengths_job(tmp_path: Path, name: str, store: str, *args: str,
                 precompile: bool = True) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One 2-rank ``recipecache-run`` job of :data:`LENGTHS_WORKER` (``args`` are its options), each rank in
    empty dirs of its own; per rank its metrics and what the worker wrote."""
    from test_multirank import RANKS, _env_without_recipecache

    run_dir = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", store, "--namespace", "lengths",
         "--run-dir", str(run_dir), "--rank-dirs", str(tmp_path / f"{name}-dirs"),
         *(["--precompile"] if precompile else []), "--quiet", str(LENGTHS_WORKER), str(run_dir / "out"), *args],
        check=False, capture_output=True, text=True, env=_env_without_recipecache(), timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [(json.loads((run_dir / f"metrics-rank{r}.json").read_text()),
             json.loads((run_dir / "out" / f"rank{r}.json").read_text())) for r in range(RANKS)]


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_varying_lengths_are_precompiled_per_shape_and_fresh_ranks_trace_nothing(tmp_path: Path) -> None:
    """Issue 21: ``torch.compile(ddp)`` with torch's defaults on 3 lengths, 2 ranks meeting them rotated.

    Torch's automatic dynamic makes the second length a process traces a dynamic graph. The tier
    builds what torch would compile (issue 21, second round): rank 0 the static graph of 8, rank 1
    that of 12 and, at 16, the dynamic graph, whose guards then serve every length (rank 1's 8
    without a lookup); rank 0 loads 12 and 16. Each compile goes through the graph store, so the
    cold job compiles what it would without the tier. A second job of fresh ranks on the same
    store loads the same artifacts and traces and compiles nothing, its losses bitwise the cold
    job's (the same kernels ran) and within float tolerance of eager torch. (Round one built a
    static AOTInductor artifact per length, compiled beside the normal path's graphs.)
    """
    lengths = (8, 12, 16)  # rotated by rank: each rank traces two of them on a cold store
    store = f"file://{tmp_path / 'store'}"
    jobs = {name: _lengths_job(tmp_path, name, store, "--lengths", ",".join(map(str, lengths)))
            for name in ("cold", "fresh")}
    shapes = [{"static_per_shape": 2, "dynamic": 1}, {"static_per_shape": 1, "dynamic": 1}]  # per rank, see above
    lookups = [3, 2]
    cold, fresh = jobs["cold"], jobs["fresh"]
    for (metrics, _), want in zip(cold, shapes):
        assert metrics["precompile_fallbacks"] == {} and metrics["fallbacks"] == {}, metrics
        assert metrics["precompile_shapes"] == want, metrics["precompile_shapes"]
    assert sum(m["lookups"]["precompiled"]["put"] for m, _ in cold) == 3, "each artifact built once"
    compiled = sum(m["graph_compilation"]["TotalNumber"] for m, _ in cold)
    assert compiled == 6, "3 graphs (forward and backward), each compiled once, as without the tier"
    assert sum(m["lookups"]["aot"]["put"] for m, _ in cold) == 3, "and shared through the store as torch's own"
    for (metrics, out), (_, cold_out), want, hits in zip(fresh, cold, shapes, lookups):
        assert metrics["lookups"]["precompiled"] == {"hit": hits, "miss": 0, "put": 0}
        assert metrics["graph_compilation"]["TotalNumber"] == 0 and out["frames"] == 0, "no trace, no compile"
        assert metrics["precompile_fallbacks"] == {} and metrics["precompile_shapes"] == want
        assert out["losses"] == cold_out["losses"], "the same artifacts ran: bitwise equal"
        assert out["losses"] == pytest.approx(out["eager"], rel=1e-4, abs=1e-5), "and torch's results"


@pytest.mark.multirank
@pytest.mark.timeout(1500)
def test_fresh_ranks_compile_nothing_in_another_order_nor_on_the_normal_path(tmp_path: Path) -> None:
    """Issue 33: what a fresh job of the tier asks for is in the store, whatever order its ranks meet shapes in,
    and also when the tier does not serve a call (the normal path of a fresh process).

    Cold: 4 lengths rotated by rank, each training step followed by an eval step. Each rank
    looks up the signatures it meets before one of its dynamic graphs serves them; the length
    both ranks meet last (20) is served by the dynamic graphs only, so, before, no key held an
    artifact for it, and a fresh rank meeting it first (rotated by 3 more) precompiled it
    again. A variant that serves a new signature is now published under its key too (where
    the key is empty). And the tier's builds compiled inductor's graphs with the FX graph
    cache off (``aot_compile`` bundles them into AOTAutograd's entry) and kept torch's
    automatic-dynamic decisions to themselves, so the normal path of a fresh process (here: a
    job without the tier, its ranks also rotated by 3 more) found nothing and compiled every
    graph; now the builds publish each graph under the key the normal path computes, and the
    decisions, so that a process tracing a length first compiles the dynamic graph the tier built.
    """
    lengths = ("--lengths", "8,12,16,20", "--eval")
    store = f"file://{tmp_path / 'store'}"
    cold = _lengths_job(tmp_path, "cold", store, *lengths)
    fresh = _lengths_job(tmp_path, "fresh", store, *lengths, "--shift", "3")
    normal = _lengths_job(tmp_path, "normal", store, *lengths, "--shift", "3", precompile=False)
    for metrics, out in fresh:
        assert metrics["graph_compilation"]["TotalNumber"] == 0 and out["frames"] == 0, "no trace, no compile"
        assert metrics["precompile_fallbacks"] == {} and metrics["fallbacks"] == {}, metrics["precompile_fallback_details"]
        assert metrics["lookups"]["precompiled"]["miss"] == 0, metrics["lookups"]
        assert out["losses"] == pytest.approx(out["eager"], rel=1e-4, abs=1e-5)
    for metrics, out in normal:
        assert metrics["graph_compilation"]["TotalNumber"] == 0, "the graphs the tier compiled serve the normal path"
        assert metrics["lookups"]["fx"]["miss"] == 0 and metrics["lookups"]["fx"]["hit"] > 0, metrics["lookups"]
        assert out["losses"] == pytest.approx(out["eager"], rel=1e-4, abs=1e-5)
    for metrics, _ in cold:
        assert metrics["precompile_fallbacks"] == {} and metrics["fallbacks"] == {}, metrics
    compiled = sum(m["graph_compilation"]["TotalNumber"] for m, _ in cold)
    assert sum(m["lookups"]["fx"]["put"] for m, _ in cold) == compiled, "every graph the cold job compiled is published"


# -- in process, no compiles ------------------------------------------------------------------
def test_precompiled_artifact_round_trip_and_refusals() -> None:
    from recipecache.torch_integration.artifact import KernelFile

    art = Precompiled(b"torch bytes", (SourceFile("/m.py", b"\1" * 32, ("SHIFT",)),), 2.5,
                      files=(KernelFile("ab/cabc.main.so", b"\x7fELF"),), dynamic=True,
                      pins=(Pin("G['cfg'].SCALE", "float:2.0", True),), groups=(("3", "2@0,1"),),
                      modules=(("___module_collections_1_c0", "collections"),),
                      scopes=(("___unnamed_scope_1_c0", "m:Point.__new__"),))
    assert Precompiled.unpack(art.pack()) == art
    verdict = Precompiled(b"", (), 1.0, "Unsupported: graph break")
    assert Precompiled.unpack(verdict.pack()).unsupported == "Unsupported: graph break"
    good = msgpack.unpackb(art.pack())
    for broken in ({**good, "format": "other/1"}, {**good, "sources": [["/m.py", b"short", []]]},
                   {**good, "sources": [["/m.py", b"\1" * 32, [3]]]},
                   {**good, "compile_s": -1.0}, {**good, "entry": "text"}, {**good, "unsupported": 3},
                   {**good, "files": [{"path": "../../etc/x.so", "data": b""}]}, {**good, "files": None},
                   {**good, "dynamic": 1}, {**good, "pins": None}, {**good, "pins": [["k", "float:2.0"]]},
                   {**good, "pins": [["k", b"float:2.0", False]]}, {**good, "groups": None},
                   {**good, "groups": [["3"]]}, {**good, "groups": [["3", 2]]}, {**good, "groups": [["", "2@0,1"]]},
                   {**good, "modules": None}, {**good, "modules": [["___module_os_1_c0"]]},
                   {**good, "modules": [["___module_os_1_c0", ""]]}, {**good, "scopes": None},
                   {**good, "scopes": [["___unnamed_scope_1_c0"]]}):
        with pytest.raises(ArtifactError):
            Precompiled.unpack(msgpack.packb(broken))
    with pytest.raises(ArtifactError):
        Precompiled.unpack(b"\x80\x04K\x01.")  # a pickle is not an artifact


SCOPED = """import collections

Point = collections.namedtuple("Point", ["x", "y"])
"""


def test_an_unnamed_scope_is_named_by_the_function_that_holds_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo guards the namespace of a namedtuple's ``__new__`` (made by ``eval``: it belongs to no module) under
    ``___unnamed_scope_<id>_c0``, a name no other process has: torch_geometric's generated ``propagate`` made every
    such artifact ``value_changed`` elsewhere. The artifact names the function; a loader binds its own namespace."""
    from recipecache.torch_integration.precompiled.traced_values import install_scopes, scopes_installed

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "scoped_model.py").write_text(SCOPED)
    monkeypatch.delitem(sys.modules, "scoped_model", raising=False)
    import scoped_model

    namespace = scoped_model.Point.__new__.__globals__
    producer = {"___unnamed_scope_140_c0": namespace, "___unnamed_scope_141_c1": {"nobody": "holds this"}}
    scopes = scopes_installed(producer)
    assert scopes == (("___unnamed_scope_140_c0", "scoped_model:Point.__new__"),)
    loader: dict[str, Any] = {}
    install_scopes(scopes, loader)
    assert loader == {"___unnamed_scope_140_c0": namespace}
    with pytest.raises(ValueError):
        install_scopes(scopes, {"___unnamed_scope_140_c0": {}})
    with pytest.raises(AttributeError):
        install_scopes((("___unnamed_scope_140_c0", "scoped_model:Gone.__new__"),), {})


CODE_V1 = """NAMES = {"a", "b", "c"}
SHIFT = 2


def f(x):
    return helper(x) if x not in {"p", "q"} else None


def helper(x):
    return x + SHIFT
"""


def _load(path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "cd_model") -> Any:
    """Import ``path`` as module ``name`` (replacing any earlier one), as this process's version of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_code_digests_follow_the_code_this_process_runs_not_the_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18 item 5: a process that imported v1 refuses v2's artifact although the file now holds v2."""
    from recipecache.torch_integration.precompiled import code_digest

    path = tmp_path / "cd_model.py"
    path.write_text(CODE_V1)
    v1 = _load(path, monkeypatch)
    ran_v1 = code_digest.of_traced([v1.f.__code__, v1.helper.__code__])  # what dynamo traced
    assert [(s.path, s.names) for s in ran_v1] == [(str(path), ("SHIFT", "helper"))]
    assert code_digest.stale(ran_v1) == []
    path.write_text(CODE_V1.replace("x + SHIFT", "x - 5"))  # the shared checkout is edited
    assert code_digest.stale(ran_v1) == [], "this process still runs v1"
    assert code_digest.current(ran_v1) == ran_v1, "the lookup key names v1 too"
    v2 = _load(path, monkeypatch)  # as another process would import it now
    ran_v2 = code_digest.of_traced([v2.f.__code__, v2.helper.__code__])
    assert ran_v2 != ran_v1
    monkeypatch.setitem(sys.modules, "cd_model", v1)
    assert code_digest.stale(ran_v2) == [str(path)], "v2's artifact is not loaded by the process running v1"

    monkeypatch.setattr(v1, "NAMES", {"other"})  # a global the traced code does not read
    assert code_digest.stale(ran_v1) == []
    monkeypatch.setattr(v1, "SHIFT", 3)  # one it reads: baked into the graph (aot_compile drops global guards)
    assert code_digest.stale(ran_v1) == [str(path)]
    monkeypatch.setattr(v1, "SHIFT", 2)

    path.write_text(CODE_V1)  # v1 again, in processes with other hash seeds: the same digest
    script = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('cd_model', {str(path)!r}); "
              "m = importlib.util.module_from_spec(spec); sys.modules['cd_model'] = m; spec.loader.exec_module(m); "
              "from recipecache.torch_integration.precompiled import code_digest; "
              "print(code_digest.of_traced([m.f.__code__, m.helper.__code__])[0].digest.hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert bytes.fromhex(out.stdout.strip()) == ran_v1[0].digest
    gone = SourceFile(str(tmp_path / "gone.py"), ran_v1[0].digest)
    assert code_digest.stale([gone]) == [gone.path], "a file this process holds no code of"


def test_a_module_generated_into_the_temporary_directory_is_named_by_its_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_geometric renders each MessagePassing's ``propagate`` into ``$TMPDIR/<module>_<random>.py`` under a fixed
    module name: a path no other process has, so every artifact naming it was ``source_changed`` elsewhere and a
    fresh job compiled again. Such a file is named by its module; the loader digests its own module of that name."""
    import tempfile

    from recipecache.torch_integration.precompiled import code_digest

    def generate(directory: Path, suffix: str, code: str) -> Any:
        directory.mkdir(exist_ok=True)
        monkeypatch.setattr(tempfile, "tempdir", str(directory))
        path = directory / f"gen_propagate_{suffix}.py"
        path.write_text(code)
        return _load(path, monkeypatch, "gen_propagate")

    built = code_digest.of_traced([generate(tmp_path / "producer", "n9e_gi6a", CODE_V1).f.__code__])
    assert [s.path for s in built] == ["module:gen_propagate"]
    generate(tmp_path / "loader", "vx5d_0uq", CODE_V1)  # another process: the same code, another file name
    assert code_digest.stale(built) == [] and code_digest.current(built) == built
    generate(tmp_path / "loader", "k2p_7zz", CODE_V1.replace("x + SHIFT", "x - 5"))  # other code under that name
    assert code_digest.stale(built) == ["module:gen_propagate"]
    monkeypatch.delitem(sys.modules, "gen_propagate")
    assert code_digest.stale(built) == ["module:gen_propagate"], "a process without the module"

    # a checkout in the temporary directory: its modules and packages are found by import, and keep their paths
    package = tmp_path / "loader" / "checkout" / "gen_package"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CODE_V1)
    (package / "helpers.py").write_text(CODE_V1)
    monkeypatch.syspath_prepend(str(package.parent))
    for name in ("gen_package", "gen_package.helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import gen_package.helpers

    ran = code_digest.of_traced([gen_package.f.__code__, gen_package.helpers.f.__code__])
    assert [s.path for s in ran] == [str(package / "__init__.py"), str(package / "helpers.py")]

    # the script there, under multiprocessing's second name for it too (``__mp_main__``: a compile pool started)
    script_path = package.parent / "train.py"
    script_path.write_text(CODE_V1)
    script = _load(script_path, monkeypatch, "__main__")
    monkeypatch.setitem(sys.modules, "__mp_main__", script)
    assert [s.path for s in code_digest.of_traced([script.f.__code__])] == [str(script_path)]


UNIT_CFG = """import torch

SCALE = 2.0


class Base(torch.nn.Module):
    FACTOR = 3.0
"""
UNIT_MODEL = """import torch
import pvu_cfg as cfg

W = torch.ones(3)


def f(x, k=2.0):
    return x * k * cfg.SCALE + W


def make(cell):
    def g(x):
        return x + cell
    return g


class Net(cfg.Base):
    def __init__(self):
        super().__init__()
        self.scale = 5.0

    def forward(self, x):
        return x * self.scale + self.FACTOR
"""


def test_traced_values_are_recorded_and_checked_against_this_process(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34, in one process (torch's ``aot_eager`` backend: tracing and guards are the tier's, no compiler):
    what torch's loaded guards no longer compare with the traced value is recorded, and a loaded function
    refuses a call once one of them differs here: another module's attribute, a class attribute read through
    ``self`` (its guard's expected value is read again at load), a default, a closure cell; and a global
    tensor rebound after load is the one the call passes (torch's function keeps a copy of the globals)."""
    import torch
    from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
    from torch._dynamo.convert_frame import get_traced_fn
    from torch._dynamo.hooks import Hooks

    from recipecache.torch_integration.precompiled.traced_values import Recorder, parse, rebind, values_of

    assert parse("dict(type(self).__mro__[1].__dict__)['FACTOR']") == (
        "L", "self", (("type", None), ("attr", "__mro__"), ("item", 1), ("attr", "__dict__"), ("dict", None),
                      ("item", "FACTOR")))
    assert parse("___odict_getitem(self._modules, 'fc1').inplace") == (
        "L", "self", (("attr", "_modules"), ("item", "fc1"), ("attr", "inplace")))
    assert parse("G['cfg'].SCALE") == ("G", "cfg", (("attr", "SCALE"),)) and parse("len(x)") is None
    (tmp_path / "pvu_cfg.py").write_text(UNIT_CFG)
    (tmp_path / "pvu_model.py").write_text(UNIT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import pvu_cfg
    import pvu_model

    x = torch.ones(3)
    backend = torch._dynamo.lookup_backend("aot_eager")

    def publish(target: Any) -> tuple[bytes, Any]:
        recorder = Recorder()
        fn = aot_compile_fullgraph(target, ((x,), {}), hooks=Hooks(guard_filter_fn=recorder), backend=backend)
        assert recorder.unchecked == []
        return AOTCompiledFunction.serialize(fn).serialized_data, recorder.pins

    def load(target: Any, published: tuple[bytes, Any]) -> Any:
        function, bound = get_traced_fn(target)
        prefix = () if bound is None else (bound,)
        fn = AOTCompiledFunction.deserialize(published[0], function.__globals__)
        rebind(fn, function)
        values = values_of(fn, published[1], function.__globals__)
        return lambda every: values.changed(lambda: fn.prepare_f_locals(*prefix, x), every=every), fn, values

    f, net = publish(pvu_model.f), publish(pvu_model.Net())
    g = publish(pvu_model.make(1.0))
    assert {p.source: p.per_call for p in f[1]} == {"G['cfg']": True, "G['cfg'].SCALE": True, "k": False, "G['W']": True}

    changed, fn, values = load(pvu_model.f, f)
    assert changed(True) is None and fn(x)[0].item() == 5.0
    monkeypatch.setattr(pvu_cfg, "SCALE", 4.0)  # a global changed at run time: checked before every call
    assert changed(False) == "G['cfg'].SCALE is float:4.0, traced as float:2.0"
    monkeypatch.setattr(pvu_cfg, "SCALE", 2.0)
    monkeypatch.setattr(pvu_model, "W", torch.full((3,), 7.0))  # rebound, the guard's shape and dtype hold
    assert changed(False) is None
    values.refresh(fn)
    assert fn(x)[0].item() == 11.0, "the call passes this process's tensor, not the copy taken at load"
    monkeypatch.setattr(pvu_model.f, "__defaults__", (3.0,))  # an edited default
    assert load(pvu_model.f, f)[0](True) == "k is float:3.0, traced as float:2.0"

    monkeypatch.setattr(pvu_cfg.Base, "FACTOR", 4.0)  # through self: torch's guard would expect 4.0 here
    assert load(pvu_model.Net(), net)[0](True) == (
        "dict(type(self).__mro__[1].__dict__)['FACTOR'] is float:4.0, traced as float:3.0")
    assert load(pvu_model.make(2.0), g)[0](True) == "cell is float:2.0, traced as float:1.0"
    changed, fn, _ = load(pvu_model.make(1.0), g)
    assert changed(True) is None and fn(x)[0].item() == 2.0


BUILTIN_MODEL = """def f(x):
    return [t * 2 for t in iter((x, x + 1))][1]
"""
BUILTIN_LOADER = """import pickle, sys
import torch
from torch._dynamo.aot_compile import AOTCompiledFunction
from recipecache.torch_integration.precompiled.traced_values import rebind, values_of
import pvb_model
entry, pins = pickle.loads(open(sys.argv[1], "rb").read())
fn = AOTCompiledFunction.deserialize(entry, pvb_model.f.__globals__)
rebind(fn, pvb_model.f)
values = values_of(fn, pins, pvb_model.f.__globals__)
x = torch.ones(3)
print(values.changed(lambda: fn.prepare_f_locals(x), every=True))
"""


def test_a_builtin_the_trace_read_is_this_processs_builtin_in_a_fresh_process(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: dynamo names the builtins it reads through a global it installs only while tracing
    (``G['__builtins_dict___0']['iter']``). A fresh process has no such global: it refused every artifact
    whose code calls a builtin as ``value_changed`` (14 fallbacks in cold_bench's fresh job), where the
    builtin is the very one traced."""
    import pickle

    import torch
    from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    from recipecache.torch_integration.precompiled.traced_values import Recorder

    (tmp_path / "pvb_model.py").write_text(BUILTIN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import pvb_model

    recorder = Recorder()
    fn = aot_compile_fullgraph(pvb_model.f, ((torch.ones(3),), {}), hooks=Hooks(guard_filter_fn=recorder),
                               backend=torch._dynamo.lookup_backend("aot_eager"))
    sources = [pin.source for pin in recorder.pins]  # N counts this process's traces so far
    assert len(sources) == 1 and re.fullmatch(r"G\['__builtins_dict___\d+'\]\['iter'\]", sources[0]), \
        f"the case is still there: {sources}"
    published = tmp_path / "published.pkl"
    published.write_bytes(pickle.dumps((AOTCompiledFunction.serialize(fn).serialized_data, recorder.pins)))
    (tmp_path / "loader.py").write_text(BUILTIN_LOADER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    loaded = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(published)], env=env,
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "None"
    changed = BUILTIN_LOADER.replace("x = torch.ones(3)\n", "x = torch.ones(3)\nimport builtins\n"
                                     "real = builtins.iter\nbuiltins.iter = lambda *args: real(*args)\n")
    (tmp_path / "loader.py").write_text(changed)  # a builtin replaced in that process still differs
    loaded = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(published)], env=env,
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip().startswith(f"{sources[0]} is function:")


def test_keys_leave_dynamic_sizes_to_the_guards() -> None:
    import torch

    from recipecache.torch_integration.precompiled.keys import key_signature, signature, stable_repr

    x = torch.zeros(8, 3)
    torch._dynamo.mark_dynamic(x, 0)
    sig = signature(None, (x, 2), {})
    other = signature(None, (torch.zeros(5, 3), 2), {})
    assert sig != other, "the dispatcher tells sizes apart"
    assert key_signature(sig, False) != key_signature(signature(None, (torch.zeros(8, 4), 2), {}), False)
    assert key_signature(sig, True) == key_signature(other, True), "dynamic: sizes are the guards' business"
    assert key_signature(sig, False)[1][0][5] == (None, 3), "a dimension marked dynamic is not in the key"
    assert stable_repr({"b": {3, 1, 2}, "a": [1]}) == stable_repr({"a": [1], "b": {2, 1, 3}})


def test_call_keys_tell_apart_what_signatures_tell_apart() -> None:
    """Issue 33 (steady steps): the dispatcher memoizes each call's signature under a call key read in a fraction
    of the time; two calls with equal call keys must have equal signatures (the store key is made of those)."""
    import torch

    from recipecache.torch_integration.precompiled.keys import call_key, signature

    module = torch.nn.Linear(3, 3)
    x, y = torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.long)
    marked = torch.zeros(4, 3)
    torch._dynamo.mark_dynamic(marked, 0)
    calls = [(x, y), (torch.ones(4, 3), y), (torch.zeros(5, 3), y), (x.t(), y), (x.requires_grad_(False).double(), y),
             (marked, y), (x,), (x, torch.zeros(4, 3, requires_grad=True)), (x, y, y)]
    keys = {}
    for args in calls:
        keys.setdefault(call_key(module, args, {}), set()).add(signature(module, args, {}))
    with torch.no_grad():
        keys.setdefault(call_key(module, (x, y), {}), set()).add(signature(module, (x, y), {}))
    module.eval()
    keys.setdefault(call_key(module, (x, y), {}), set()).add(signature(module, (x, y), {}))
    assert all(len(sigs) == 1 for sigs in keys.values()), "one signature per call key"
    assert len(keys) == 10, "the ones and zeros of one shape share a key; everything else differs"
    other = (x, 2)
    assert call_key(module, other, {}) == signature(module, other, {}), "any other call is keyed by its signature"
    assert call_key(module, (x,), {"y": y}) == signature(module, (x,), {"y": y})


def test_a_steady_call_reads_no_signature_and_describes_no_pin_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 (steady steps): per call the dispatcher reads the call key and the pins, but the signature once per
    call key and a pin's description only when its object changed; a changed or rebound value is still seen."""
    from collections import OrderedDict

    import torch

    from recipecache import torch_integration
    from recipecache.torch_integration.precompiled import tier as precompile
    from recipecache.torch_integration.precompiled.traced_values import Values, describe

    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        module = torch.nn.Linear(2, 2)
        dispatcher = torch.compile(module).forward
        resolved: list[str] = []

        def resolve(target: Any, key: str, args: Any, kwargs: Any) -> precompile.Fallback:
            resolved.append(key)
            return dispatcher.tier.fallback(precompile.PrecompileDetail.PRECOMPILE_FAILED, "not compiled in this test")

        monkeypatch.setattr(dispatcher.tier, "resolve", resolve)
        for _ in range(3):
            for rows in (1, 2):
                assert dispatcher.run(module, (torch.zeros(rows, 2),), {}, lambda *a: "normal") == "normal"
        assert dispatcher.signatures_read == 2 == len(resolved), "one signature read per call key, not per call"
    finally:
        torch_integration.disable()

    hooks: OrderedDict[int, Any] = OrderedDict()
    scope = {"torch": torch, "hooks": hooks}
    pins = (Pin("G['torch']", describe(torch), True), Pin("G['torch'].nn", describe(torch.nn), True),
            Pin("G['hooks']", describe(hooks), True), Pin("G['gone']", describe(1), True))
    values = Values(pins[:3], scope, {})
    assert values.changed(dict, every=False) is None and values.described == 3
    assert values.changed(dict, every=False) is None and values.described == 3, "the same objects: nothing described"
    hooks[1] = print  # the same dict, no longer empty
    assert values.changed(dict, every=False) == f"G['hooks'] is {describe(hooks)}, traced as {describe(OrderedDict())}"
    del hooks[1]
    scope["torch"] = __import__("math")  # a global rebound
    assert values.changed(dict, every=False) == "G['torch'] is module:math, traced as module:torch"
    assert Values(pins[3:], scope, {}).changed(dict, every=False) == "G['gone'] is missing, traced as int:1"


def test_variants_are_tried_most_recently_used_first_as_dynamo_tries_its_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size the static variant served before goes to the dynamic variant once that one joined and served, as
    dynamo's cache entries are tried most recently used first: diffusers' UNet at sizes 16, 24, 16 ran the static
    graph at the third step here and the dynamic one under plain torch.compile, whose kernels round otherwise
    (losses 1.2e-7 apart). A size only the static variant accepts still goes to it."""
    import torch

    from recipecache import torch_integration
    from recipecache.torch_integration.precompiled.traced_values import Values
    from recipecache.torch_integration.precompiled.variant import Variant

    class Compiled:
        """A loaded function whose guards accept the sizes given."""

        def __init__(self, name: str, sizes: set[int]) -> None:
            self.name, self.sizes = name, sizes
            self.fn = lambda: None  # torch's function, whose globals a call points at this process's (none here)

        def prepare_f_locals(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {}

        def guard_check(self, x: torch.Tensor) -> bool:
            return x.shape[0] in self.sizes

        def __call__(self, x: torch.Tensor) -> str:
            return self.name

    static = Variant(Compiled("static", {16}), (), Values((), {}, {}))
    dynamic = Variant(Compiled("dynamic", {16, 24}), (), Values((), {}, {}), dynamic=True)
    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        module = torch.nn.Linear(2, 2)
        dispatcher = torch.compile(module).forward
        served = iter([static, dynamic])
        monkeypatch.setattr(dispatcher.tier, "resolve", lambda *a: next(served))
        monkeypatch.setattr(dispatcher.tier.builder, "share", lambda *a: None)

        def call(rows: int) -> str:
            return str(dispatcher.run(module, (torch.zeros(rows, 2),), {}, lambda *a: "normal"))

        assert [call(rows) for rows in (16, 24, 16, 16, 24)] == ["static"] + ["dynamic"] * 4
        dynamic.fn.sizes = {24}  # as if its guards rejected 16 now: the static variant serves it again
        assert [call(rows) for rows in (16, 24)] == ["static", "dynamic"]
    finally:
        torch_integration.disable()


def test_calls_off_the_cpu_run_on_the_normal_path_counted() -> None:
    """The tier is checked on the CPU only (a cold precompile on CUDA crashed its process): a call whose inputs,
    parameters or buffers live elsewhere is a counted ``device_unchecked`` fallback, decided before any compile."""
    import torch

    from recipecache import torch_integration
    from recipecache.torch_integration.precompiled.dispatcher import unchecked_devices
    from recipecache.torch_integration.precompiled.variant import Fallback
    from recipecache.torch_integration.precompiled.keys import signature

    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        decided = {}
        for name, device, input_device in (("cpu", "cpu", "cpu"), ("inputs", "cpu", "meta"),
                                           ("parameters", "meta", "cpu")):
            module = torch.nn.Linear(2, 2, device=device)
            dispatcher = torch.compile(module).forward
            args = (torch.zeros(3, 2, device=input_device),)
            target = dispatcher.target(module)
            decided[name] = unchecked_devices(target, signature(module, args, {}))
            if decided[name]:
                fallback = dispatcher._resolve(module, signature(module, args, {}), args, {})
                assert isinstance(fallback, Fallback) and fallback.detail == "device_unchecked"
        assert decided == {"cpu": set(), "inputs": {"meta"}, "parameters": {"meta"}}
        assert torch_integration.metrics()["precompile_fallbacks"] == {"device_unchecked": 2}
    finally:
        torch_integration.disable()


def test_a_callable_gets_at_most_max_shapes_signatures_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21: static artifacts are per signature, so their number is bounded per compiled callable; past the
    bound a new signature runs on the normal path (its dynamic graph) as ``too_many_shapes``, decided before
    the store is asked. The store round trip is replaced here: this is the dispatcher's count, not a compile."""
    import torch

    from recipecache import torch_integration
    from recipecache.torch_integration.precompiled import dispatcher as precompile
    from recipecache.torch_integration.precompiled.variant import Fallback
    from recipecache.torch_integration.precompiled.keys import signature

    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        module = torch.nn.Linear(2, 2)
        dispatcher = torch.compile(module).forward
        looked_up: list[str] = []

        def resolve(target: Any, key: str, args: Any, kwargs: Any) -> Fallback:
            looked_up.append(key)
            return dispatcher.tier.fallback(precompile.PrecompileDetail.PRECOMPILE_FAILED, "not compiled in this test")

        monkeypatch.setattr(dispatcher.tier, "resolve", resolve)
        monkeypatch.setattr(precompile, "MAX_SHAPES", 2)
        decided = []
        for rows in (1, 2, 3, 1, 4):
            args = (torch.zeros(rows, 2),)
            decided.append(dispatcher._resolve(module, signature(module, args, {}), args, {}).detail)
        assert len(looked_up) == 2 == len(set(looked_up)), "one lookup per signature, at most MAX_SHAPES"
        assert decided == ["precompile_failed", "precompile_failed", "too_many_shapes", "precompile_failed",
                           "too_many_shapes"]
        assert torch_integration.metrics()["precompile_fallbacks"] == {"precompile_failed": 2, "too_many_shapes": 2}
    finally:
        torch_integration.disable()


def test_precompiled_keys_are_cpu_keys_like_the_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefix and host-CPU fingerprint for every CPU artifact: another CPU kind gets another key."""
    import torch

    from recipecache import env, torch_integration
    from recipecache.torch_integration.graphs.artifacts import KEY_PREFIX
    from recipecache.torch_integration.precompiled.keys import signature

    keys = []
    for cpu in ("avx512-amx-host", "avx2-host"):
        monkeypatch.setenv(env.CPU_FINGERPRINT, cpu)
        torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
        try:
            module = torch.nn.Linear(2, 2)
            dispatcher = torch.compile(module).forward
            args = (torch.zeros(3, 2),)
            keys.append(dispatcher.key(dispatcher.target(module), signature(module, args, {})))
        finally:
            torch_integration.disable()
    assert keys[0].startswith(f"{KEY_PREFIX}cpu-avx512-amx-host:precompiled:")
    assert keys[1].startswith(f"{KEY_PREFIX}cpu-avx2-host:precompiled:")
    assert keys[0].split(":")[-1] == keys[1].split(":")[-1], "only the CPU part differs"


def test_compile_on_one_rank_enters_precompiled_keys_only_when_on() -> None:
    """torch's compile-on-one-rank changes what AOTInductor generates for devices and process groups
    (2.14 keys its own graphs by it); it is in none of the configs the key hashes whole, so a process with it
    on would have loaded an artifact built with it off. Off (the default) leaves every key as it was."""
    from recipecache.torch_integration.precompiled.keys import CompileSettings

    settings = CompileSettings.from_call({})
    off = settings.fingerprint()
    assert "configs" not in off
    with compile_on_one_rank():
        on = settings.fingerprint()
    assert on.keys() == {*off, "configs"} and "'compile_on_one_rank': True" in on["configs"]
    assert {k: v for k, v in on.items() if k != "configs"} == off


@pytest.mark.internals
def test_every_config_module_and_flag_a_compile_reads_enters_precompiled_keys() -> None:
    """Issue 44 item 4: inductor reads ``torch.fx.experimental._config.backed_size_oblivious`` (``sizevars``),
    and oneDNN's and cuDNN's precisions (its lowering), none of which the key held (it hashed dynamo's, inductor's
    and functorch's configs and the thread count): a process that set one loaded an artifact compiled under the
    other value. Every config module loaded (found, not listed: each one the test finds itself) and every flag
    now changes the key, and a default leaves it as it was."""
    import sys

    import torch
    import torch.fx.experimental._config as fx_config
    from torch.utils._config_module import ConfigModule

    from recipecache.torch_integration.precompiled.keys import CompileSettings

    settings = CompileSettings.from_call({})
    default = settings.fingerprint()
    with fx_config.patch(backed_size_oblivious=True):
        assert settings.fingerprint() != default
    found = [name for name, m in list(sys.modules.items()) if isinstance(m, ConfigModule) and "testing" not in name]
    assert "torch.fx.experimental._config" in found and "torch._export.config" in found
    for name in found:  # one setting of each module changed: the key sees it
        module = sys.modules[name]
        config, value = _another_value(module)
        with module.patch(config, value):
            assert settings.fingerprint() != default, f"{name}.{config}"
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = not allow_tf32  # read by inductor's convolution lowering, outside torch's keys
    try:
        assert settings.fingerprint() != default
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    assert settings.fingerprint() == default


def _another_value(module: Any) -> tuple[str, Any]:
    """A setting of config module ``module`` that is no cache switch, and another value for it: a boolean flipped,
    else a whole number plus one (a backend's codegen config, as the no-stall tests register one, may hold no
    boolean)."""
    values = [(config, value) for config, value in sorted(module.save_config_portable(ignore_private_configs=False).items())
              if not any(p in config for p in ("cache", "pgo")) and config != "TYPE_CHECKING"]
    flags = [(config, not value) for config, value in values if isinstance(value, bool)]
    numbers = [(config, value + 1) for config, value in values if type(value) is int]
    return (flags or numbers)[0]


def test_precompile_fallback_details_are_one_vocabulary() -> None:
    """Issue 19: every detail the tier counts is a member of ``PrecompileDetail`` (or a ``Reason``); a stored
    verdict no version of the tier publishes is a malformed artifact, not a detail of its own."""
    from types import SimpleNamespace

    from recipecache.reasons import VERDICTS, PrecompileDetail, Reason
    from recipecache.torch_integration.metrics import Metrics
    from recipecache.torch_integration.precompiled.tier import Tier
    from recipecache.torch_integration.precompiled.variant import Fallback

    assert VERDICTS == {PrecompileDetail.GRAPH_BREAK, PrecompileDetail.UNCHECKED_VALUE}
    store = recipecache.open_store("memory://", namespace=NAMESPACE)
    metrics = Metrics(store, None, flush=False)
    tier = Tier(store, metrics, 0.5, lambda key: key)  # not installed: torch.compile stays as it is
    target = SimpleNamespace(name="f")
    for stored, detail in (("graph_break", PrecompileDetail.GRAPH_BREAK), ("Unsupported: graph break", Reason.BAD_ARTIFACT)):
        fallback = tier._load(target, "k", Precompiled(b"", (), 1.0, stored), (), {})  # type: ignore[arg-type]
        assert isinstance(fallback, Fallback) and fallback.detail is detail
    assert metrics.snapshot()["precompile_fallbacks"] == {"graph_break": 1, "bad_artifact": 1}



def test_a_load_failure_is_listed_with_its_exception_in_the_metrics() -> None:
    """Issue 33: a count of ``load_failed`` says nothing about why; the metrics list each fallback with the
    exception behind it (type and message, bounded), so a fresh job's report tells what to fix."""
    from types import SimpleNamespace

    from recipecache.torch_integration.metrics import MAX_DETAIL_CHARS, MAX_FALLBACK_DETAILS, Metrics
    from recipecache.torch_integration.precompiled.tier import Tier
    from recipecache.torch_integration.precompiled.variant import Fallback

    from torch._dynamo.aot_compile import AOTCompiledFunction

    garbage = b"not torch's pickle" * 100
    with pytest.raises(Exception) as raised:  # what this torch raises for it (2.15 checks a header before unpickling)
        AOTCompiledFunction.deserialize(garbage, {})
    store = recipecache.open_store("memory://", namespace=NAMESPACE)
    metrics = Metrics(store, None, flush=False)
    tier = Tier(store, metrics, 0.5, lambda key: key)  # not installed: torch.compile stays as it is
    target = SimpleNamespace(name="f", globals={}, prefix=())
    for n in range(MAX_FALLBACK_DETAILS + 2):
        stored = Precompiled(garbage, (), 1.0)
        fallback = tier._load(target, f"k{n}", stored, (), {})  # type: ignore[arg-type]
        assert isinstance(fallback, Fallback) and fallback.detail == "load_failed"
    snapshot = metrics.snapshot()
    assert snapshot["precompile_fallbacks"] == {"load_failed": MAX_FALLBACK_DETAILS + 2}
    details = snapshot["precompile_fallback_details"]
    assert len(details) == MAX_FALLBACK_DETAILS, "bounded; the count goes on"
    first = details[0]
    assert first["detail"] == "load_failed" and "k0 does not load here" in first["message"]
    error_type = type(raised.value)
    named = error_type.__qualname__ if error_type.__module__ == "builtins" else \
        f"{error_type.__module__}.{error_type.__qualname__}"
    assert first["error"].startswith(f"{named}: {str(raised.value)[:40]}"), first
    assert all(len(d["message"]) <= MAX_DETAIL_CHARS and len(d["error"]) <= MAX_DETAIL_CHARS for d in details)


def test_the_tier_counts_each_lookup_and_store_failure_once() -> None:
    """Issue 19, "count once": a stored verdict is a hit that means "run the normal path": one miss, in the store's
    stats and the metrics alike (the store counted a hit, the metrics a miss); a store that did not answer is the
    store's fallback ``backend_down``, once, with its detail apart (it was ``backend_down`` and again
    ``precompile_fallback`` in one dict)."""
    from types import SimpleNamespace

    from recipecache.torch_integration.metrics import Metrics
    from recipecache.torch_integration.precompiled.tier import Tier
    from recipecache.torch_integration.precompiled.variant import Fallback

    target = SimpleNamespace(name="f")
    store = recipecache.open_store("memory://", namespace=NAMESPACE)
    store.put("verdict", Precompiled(b"", (), 1.0, "graph_break").pack())
    metrics = Metrics(store, None, flush=False)
    fallback = Tier(store, metrics, 0.5, lambda key: key).resolve(target, "verdict", (), {})  # type: ignore[arg-type]
    assert isinstance(fallback, Fallback) and fallback.detail == "graph_break"
    m = metrics.snapshot()
    assert (m["store"]["hits"], m["store"]["misses_by_reason"]) == (0, {"precompile_fallback": 1})
    assert m["lookups"]["precompiled"] == m["store"]["by_kind"]["precompiled"] == {"hit": 0, "miss": 1, "put": 0}
    assert m["fallbacks"] == {"precompile_fallback": 1} and m["precompile_fallbacks"] == {"graph_break": 1}

    down = recipecache.open_store("redis://127.0.0.1:1/0?timeout=0.5", namespace=NAMESPACE)
    metrics = Metrics(down, None, flush=False)
    fallback = Tier(down, metrics, 0.5, lambda key: key).resolve(target, "k", (), {})  # type: ignore[arg-type]
    assert isinstance(fallback, Fallback) and fallback.detail == "backend_down"
    m = metrics.snapshot()
    assert m["fallbacks"] == m["store"]["fallback_by_reason"] == {"backend_down": 1}
    assert m["precompile_fallbacks"] == {"backend_down": 1}
    assert m["lookups"]["precompiled"] == {"hit": 0, "miss": 1, "put": 0}


def test_enable_with_precompile_wraps_torch_compile_and_disable_restores_it() -> None:
    import torch
    import torch._inductor.config as inductor_config

    from recipecache import torch_integration

    before = (torch.compile, inductor_config.fx_graph_remote_cache)
    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        assert torch.compile is not before[0]
        assert inductor_config.fx_graph_remote_cache, "the normal path still uses the graph store"
        compiled = torch.compile(torch.nn.Linear(2, 2))
        assert type(compiled.forward).__name__ == "Dispatcher"
        assert torch.compile(torch.nn.Linear(2, 2), backend="eager").forward is not None
        assert torch_integration.metrics()["precompile_fallbacks"] == {"backend": 1}
    finally:
        torch_integration.disable()
    assert (torch.compile, inductor_config.fx_graph_remote_cache) == before


def test_a_partial_is_not_precompiled_and_counted_once() -> None:
    """Issue 34: torch's ``aot_compile`` traces functions, methods and modules; a ``functools.partial`` made every
    call a ``hook_error`` (the target could not be built) and its bound arguments are values no key covers: it
    runs on the normal path, one ``callable`` fallback at compile time, whatever the number of calls."""
    import functools

    import torch

    from recipecache import torch_integration

    def scaled(x: Any, k: float) -> Any:
        return x * k

    torch_integration.enable("memory://", namespace=NAMESPACE, precompile=True)
    try:
        torch.compile(functools.partial(scaled, k=2.0))
        assert torch_integration.metrics()["precompile_fallbacks"] == {"callable": 1}
        assert torch_integration.metrics()["fallbacks"] == {"precompile_fallback": 1}
    finally:
        torch_integration.disable()


def test_launcher_precompile_flag_reaches_every_rank(tmp_path: Path) -> None:
    from launcher.launch_config import LaunchConfig
    from launcher.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["--precompile", "--url", f"file://{tmp_path / 's'}", str(script)])
    environ = LaunchConfig.from_args(args).rank_env({})
    assert environ["RECIPECACHE_PRECOMPILE"] == "1"
    args = build_parser().parse_args(["--url", f"file://{tmp_path / 's'}", str(script)])
    assert "RECIPECACHE_PRECOMPILE" not in LaunchConfig.from_args(args).rank_env({})


def test_a_torch_config_entry_the_trace_guards_is_pinned_by_its_value() -> None:
    """torch 2.15's functional collectives read ``compile_on_one_rank``; dynamo guards the entry's override, an
    object no description stands for, which made every function calling a collective a verdict on 2.15
    (``unchecked_value``). The tier pins the value the config module gives instead, checked on every call.
    (An entry every supported torch has stands in for it here.)"""
    from types import SimpleNamespace

    import torch.compiler.config  # noqa: F401 - the config module the pin reads

    from recipecache.torch_integration.precompiled.traced_values import Recorder, Values

    module = "G['__import_torch_dot_distributed_dot__functional_collectives'].torch.compiler.config"
    recorder = Recorder()
    for suffix in ("", ".get()"):  # the two guards torch 2.15 writes on the one entry: one pin
        entry = SimpleNamespace(name=f"{module}._config['capture_scalar_outputs'].user_override{suffix}",
                                guard_type="ID_MATCH", derived_guard_types=(), is_global=True, has_value=True,
                                value=object())
        recorder._record(entry, kept=False)
    assert recorder.unchecked == []
    assert [(pin.source, pin.per_call) for pin in recorder.pins] == [(f"{module}.capture_scalar_outputs", True)]
    values = Values(tuple(recorder.pins), {}, {})
    assert values.changed(dict, every=True) is None
    # torch's own patch: the entry is an alias of dynamo's, which monkeypatch's undo would leave set (it deletes
    # the alias instead), and every later test of this process would compile and key under that value
    with torch.compiler.config.patch(capture_scalar_outputs=not torch.compiler.config.capture_scalar_outputs):
        assert values.changed(dict, every=True) is not None, "a config set since the trace differs"
    unreadable = SimpleNamespace(name="L['cfg']._config['x'].user_override", guard_type="ID_MATCH",
                                 derived_guard_types=(), is_global=False, has_value=True, value=object())
    recorder._record(unreadable, kept=False)
    assert recorder.unchecked == ["L['cfg']._config['x'].user_override"], "only a module's entry is pinned"


def _hook(form: str) -> Any:
    """One of two lambdas with one qualified name, as ``distribute_module`` installs its hooks."""
    import torch

    placements = (torch.distributed.tensor.Shard(0) if form == "shard" else torch.distributed.tensor.Replicate(),)
    if form == "shard":
        return lambda mod, inputs: (placements, inputs)
    return lambda mod, inputs: (placements, inputs, mod)


def test_the_forms_a_frameworks_config_and_processor_are_guarded_in_are_followed() -> None:
    """Issue 43 (diffusers): a config dict's key by position, a dict subclass's item read past its ``__getitem__``,
    and a method's code are values the tier pins: read back in this process and described alike in two."""
    import types
    from collections import OrderedDict

    from recipecache.torch_integration.precompiled.traced_values import describe, parse, reader

    config = "self.__dict__['_internal_dict']"
    assert parse(f"list(dict.keys({config}))[1]") == ("L", "self", (("attr", "__dict__"), ("item", "_internal_dict"),
                                                                    ("key", 1)))
    item = f"dict.__getitem__({config}, list(dict.keys({config}))[1])"
    assert parse(item) == ("L", "self", (("attr", "__dict__"), ("item", "_internal_dict"), ("dict_key_at", 1)))
    assert parse(f"dict.__getitem__(self.a, list(dict.keys(self.b))[1])") is None, "another dict's key"
    assert parse("dict.__getitem__(self.a, key)") is None and parse("dict.__getitem__(self.a, ") is None

    class Config(OrderedDict):
        def __getitem__(self, key: str) -> str:
            raise AssertionError("dynamo reads past a subclass's own __getitem__")

    module = types.SimpleNamespace(_internal_dict=Config(scale=0.5, act="gelu"))
    value = module
    for step in reader(parse(item)[2]):
        value = step(value)
    assert value == "gelu"
    code = test_the_forms_a_frameworks_config_and_processor_are_guarded_in_are_followed.__code__
    assert describe(code) == describe(code.replace()) != describe(_hook.__code__)
    assert describe(code).startswith("code:test_the_forms_a_frameworks_config_and_processor_are_guarded_in_are")


def test_a_dtensor_modules_hooks_and_layout_are_checked_not_left_unchecked() -> None:
    """Issue 27: a module parallelised with ``parallelize_module`` was an ``unchecked_value`` verdict, its hooks read
    in a form the tier did not follow (``d[list(dict.keys(d))[0]]``). Now they are pinned: a hook by its code, as
    dynamo guards a closure (two lambdas of one qualified name differ), a placement by value (a C++ object,
    otherwise described by type alone); and a DTensor parameter's placements and mesh shape are in the key."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import functools
    from types import SimpleNamespace

    from recipecache.torch_integration.precompiled.keys import module_state
    from recipecache.torch_integration.precompiled.traced_values import Recorder, Values, describe, parse

    hook = "self._forward_pre_hooks[list(dict.keys(self._forward_pre_hooks))[0]]"
    assert parse(hook) == ("L", "self", (("attr", "_forward_pre_hooks"), ("key_at", 0)))
    assert parse("self._forward_hooks[list(dict.keys(self._forward_pre_hooks))[0]]") is None, "another dict's key"
    module = torch.nn.Linear(2, 2)
    handle = module.register_forward_pre_hook(_hook("shard"))
    pins = tuple(Pin(source, describe(value), per_call=True) for source, value in (
        (hook, module._forward_pre_hooks[handle.id]),
        (f"{hook}.__closure__[0].cell_contents[0]", Shard(0))))
    assert pins[0].value.startswith("function:") and "<lambda>@" in pins[0].value
    values = Values(pins, {}, {})
    assert values.changed(lambda: {"self": module}, every=True) is None
    handle.remove()
    module.register_forward_pre_hook(_hook("replicate"))  # the other lambda: same qualified name, other code
    assert values.changed(lambda: {"self": module}, every=True).startswith(hook + " is function:")
    assert describe(Shard(0)) == describe(Shard(0)) != describe(Shard(1)) != describe(Replicate())
    recorder = Recorder()  # a closure guard compares a function's code, any other object's identity
    for value in (functools.partial(print), _hook("shard")):
        recorder._record(SimpleNamespace(name=hook, guard_type="CLOSURE_MATCH", derived_guard_types=(),
                                         is_global=False, has_value=True, value=value), kept=False)
    assert recorder.unchecked == [hook] and [pin.source for pin in recorder.pins] == [hook]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        layouts = []
        for placement in (Shard(0), Replicate()):
            parallel = torch.nn.Linear(2, 2)
            parallel.weight = torch.nn.Parameter(distribute_tensor(parallel.weight, mesh, [placement]))
            layouts.append(module_state(parallel)[0][0])
        assert layouts[0] != layouts[1] and layouts[0][:5] == layouts[1][:5], layouts
        assert "Shard(dim=0)" in layouts[0][5] and "('tp',)" in layouts[0][5]
    finally:
        dist.destroy_process_group()
    assert module_state(torch.nn.Linear(2, 2))[0][0] == ("weight", "torch.float32", "cpu", (2, 2), True)


def _cold_bench() -> Any:
    """benchmarks/cold_bench.py as a module (the benchmarks are no package)."""
    import importlib.util

    path = REPO / "benchmarks" / "cold_bench.py"
    spec = importlib.util.spec_from_file_location("cold_bench_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _bench_run(bench: Any, scenario: str, iters: list[float], omp: str = "1") -> Any:
    """A cold_bench job of two ranks whose iterations took ``iters`` seconds (both ranks alike)."""
    parts = {part: [0.0] * len(iters) for part in bench.ITER_PARTS}
    rank = {"iter_s": iters, "iter_main_cpu_s": [t / 2 for t in iters], "parts": parts, "parts_cpu": parts,
            "process": {"torch_threads": 1, "OMP_NUM_THREADS": omp, "affinity": [0, 1], "nice": 0, "threads": {}},
            "steps": [], "losses": []}
    return bench.Run(scenario, "rotated", "0", 10.0, [rank, rank])


def test_cold_bench_judges_each_later_iteration_by_its_median_over_the_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33: a later iteration of the tier's fresh job is judged by its ratio to plain warm's same iteration,
    median over the pairs, not by the largest ratio of any pair (one pair's 10 ms jitter on a 30 ms iteration
    missed the target with the jobs at parity). The target itself stays: a median above 1.2x still misses it,
    and the ranks' thread settings are compared, since a difference there makes the comparison unfair."""
    bench = _cold_bench()
    warm = [_bench_run(bench, "plain warm", [10.0, 0.5, 0.03, 0.03, 0.03]) for _ in range(3)]
    jittered = [[1.0, 0.05, 0.045, 0.03, 0.03], [1.0, 0.05, 0.03, 0.03, 0.03], [1.0, 0.05, 0.03, 0.033, 0.03]]
    figures = bench.precompile_fresh_figures([_bench_run(bench, "pc fresh", i) for i in jittered], warm)
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert figures["pc_fresh_iter_medians"] == pytest.approx([1.0, 1.0, 1.0])
    assert "slowest iteration after 1 (median over the pairs) 1.00  target <= 1.2: met" in verdict
    slower = [[1.0, 0.05, 0.045, 0.03, 0.03], [1.0, 0.05, 0.04, 0.03, 0.03], [1.0, 0.05, 0.03, 0.03, 0.03]]
    figures = bench.precompile_fresh_figures([_bench_run(bench, "pc fresh", i) for i in slower], warm)
    assert figures["pc_fresh_later_iter_max"] == pytest.approx(0.04 / 0.03)
    assert "target <= 1.2: MISSED" in capsys.readouterr().out.splitlines()[-1]
    pc = [_bench_run(bench, "pc fresh", [1.0, 0.05, 0.03, 0.03, 0.03], omp="2")]
    assert bench.process_differences(pc[0].process_states(), warm[0].process_states()) == [
        "rank 0 OMP_NUM_THREADS 2 vs 1",
        "rank 1 OMP_NUM_THREADS 2 vs 1",
    ]


def test_cold_bench_settles_a_later_iteration_only_when_the_interval_of_its_median_is_on_one_side(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: two processes of the same job differ by some 30% per iteration on this machine, so the median of
    3 pairs, and the largest of six such medians, lands above 1.2x by chance with the jobs at parity. The verdict
    says whether the pairs settle it: each later iteration's median with its 90% interval (distribution-free,
    from the order statistics; none below 5 pairs), within the target only when every interval is, above it when
    one interval is wholly above. The median verdict itself is unchanged. Each pair also says how much of the
    cores other processes took during each side's later iterations."""
    bench = _cold_bench()
    assert bench.median_interval([1.0, 1.1, 1.2, 1.3]) is None, "4 values: min-max misses the median 1 time in 8"
    assert bench.median_interval([0.9, 1.3, 1.0, 1.1, 0.8]) == (0.8, 1.3)
    assert bench.median_interval([float(i) for i in range(10)]) == (1.0, 8.0)

    def verdict(fresh_iters: list[list[float]]) -> tuple[dict[str, Any], str]:
        warm = [_bench_run(bench, "plain warm", [10.0, 0.5, 0.1, 0.1]) for _ in fresh_iters]
        figures = bench.precompile_fresh_figures([_bench_run(bench, "pc fresh", i) for i in fresh_iters], warm)
        return figures, capsys.readouterr().out.splitlines()[-1]

    alike = [[1.0, 0.05, 0.1 + d, 0.1 - d] for d in (0.0, 0.01, -0.01, 0.005, -0.005, 0.01, -0.01)]
    figures, line = verdict(alike)
    assert figures["pc_fresh_iter_median_intervals"] == [pytest.approx((0.9, 1.1)), pytest.approx((0.9, 1.1))]
    assert "target <= 1.2: met (every iteration within 1.2x at 90% confidence)" in line
    above = [[1.0, 0.05, 0.15 + d, 0.1] for d in (0.0, 0.01, -0.01, 0.005, -0.005, 0.01, -0.01)]
    assert "target <= 1.2: MISSED (iteration(s) 2 above 1.2x at 90% confidence)" in verdict(above)[1]
    spread_out = [[1.0, 0.05, 0.1, t] for t in (0.07, 0.08, 0.1, 0.11, 0.13, 0.15, 0.16)]
    assert "target <= 1.2: met (not settled at 90% confidence: iteration(s) 3;" in verdict(spread_out)[1]
    assert "met (not settled at 90% confidence: iteration(s) 2, 3;" in verdict(alike[:3])[1], "3 pairs settle nothing"

    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    run = _bench_run(bench, "pc fresh", [1.0, 0.05, 0.1, 0.1])
    for rank in run.ranks:
        rank.update(iter_cpu_s=[1.0, 0.05, 0.05, 0.05], iter_machine_busy_s=[2.0, 0.1, 0.15, 0.15])
    assert run.others_share(2) == pytest.approx((0.3 - 0.2) / (0.2 * 2)), "the machine's busy time less the ranks'"


FRAMEWORK_WORKER = WORKERS / "precompile_framework_model.py"


@pytest.mark.internals
@pytest.mark.timeout(900)
def test_a_model_written_as_frameworks_write_theirs_loads_in_a_fresh_process(tmp_path: Path) -> None:
    """Issue 43, the forms real frameworks' models broke the tier with (``tests/workers/precompile_framework_model``):

    * a shape first met while the parameters hold gradients (Lightning, HF Trainer): torch's guard-state pickler
      wrote an unread gradient as its ``_Missing`` placeholder, which its unpickler assigned to ``.grad``
      (``load_failed``, "assigned grad expected to be a Tensor or None but got grad of type _Missing");
    * a callable object's method (diffusers' attention processors): the tier's guard filter kept a
      ``CONSTANT_MATCH`` on its code that torch saves as an ``ID_MATCH`` (``precompile_failed``, "ID_MATCH guard
      cannot be serialized"); dropped now, and the code pinned by its digest;
    * a config dict's key (``list(dict.keys(self._internal_dict))[0]``): a form the tier did not follow
      (``unchecked_value``);
    * an ``OrderedDict`` subclass returned: the module global dynamo installs for ``collections`` was missing in
      every other process (``load_failed``, "Missing required external references").

    A fresh process now loads both shapes' artifacts and compiles nothing, with the cold process's losses."""
    runs = {}
    for name in ("cold", "fresh"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
        env.update(RECIPECACHE_URL=f"file://{tmp_path / 'store'}", RECIPECACHE_NAMESPACE=NAMESPACE,
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / name / "inductor"), OMP_NUM_THREADS="1")
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, str(FRAMEWORK_WORKER), str(out)], env=env, capture_output=True, text=True,
                              timeout=800, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    fresh = runs["fresh"]["metrics"]
    assert fresh["precompile_fallbacks"] == {}, fresh.get("precompile_fallback_details")
    assert fresh["lookups"]["precompiled"]["hit"] == 2 and fresh["graph_compilation"]["TotalNumber"] == 0, fresh
    assert runs["fresh"]["losses"] == runs["cold"]["losses"]
