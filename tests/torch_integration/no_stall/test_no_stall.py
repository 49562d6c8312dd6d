"""No-stall (``enable(no_stall=True)``, ``recipecache-run --no-stall``): ranks keep training while a graph compiles behind them.

* the store's non-blocking begin: a process never waits for a lease another one holds;
* a bad ``RECIPECACHE_NO_STALL`` is one line and exit status 2;
* one process whose background compile is killed: the graph runs eager, counted, training goes on, and the
  process compiles it again in a new worker and switches;
* a real 2-rank torchrun job (gloo) on a cold store, of a script that sets global torch settings before it
  compiles (tf32, float32 matmul precision, deterministic algorithms, config changed at run time: torch's
  keys read them): each rank runs graphs eagerly while a worker compiles them, every graph is compiled
  once in the job, none fails behind, every rank switches, the losses match plain torchrun's; a job of
  fresh ranks right after compiles nothing, runs nothing eagerly and traces nothing through AOTAutograd (the cold
  ranks saved its entries at their switches; a graph published after the script ended is loaded at exit for them);
* the compile pool: rank 0 alone evaluates (graphs only it meets, queued behind its worker); rank 1's idle
  worker compiles some of them for it, each graph once, and rank 0 switches to them;
* a 2-rank job whose rank 0 loses its worker mid-compile: rank 1 takes that graph over (leads it: its worker or,
  through the compile pool, an idle one compiles it) and switches, and rank 0 switches to it too;
* a graph inductor specializes while compiling it behind: after the switch, inputs its guards
  reject run without inductor (right results), never the specialized graph;
* a stuck worker (SIGSTOP): ended at the compile's deadline, or at the exit grace, its lease released;
* at exit a queued compile frees its lease, and a grace past ``threading.TIMEOUT_MAX`` still waits;
* a job never touches the temporary directory (its settings hold the secret);
* a store outage while the worker publishes: the leader still switches (torch's local cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recipecache.reasons import Role
from recipecache.runs.events import read_events
from recipecache.settings import StoreSettings
from recipecache.store import Store
from support.hang_guard import SCRIPT_TIMEOUT_S, TEST_TIMEOUT_S
from harness.paths import REPO, WORKERS

ROOT = REPO
TRAIN = WORKERS / "no_stall_train.py"
RANKS = 2
#: a no-stall job's bound against a hang while it waits for every graph to switch (it stops at the switch, the event
#: it waits for); under :func:`_launch`'s 900 s, which covers the ranks' start and exit too
UNTIL_SWITCHED_S = 720
#: the largest loss difference allowed between a step run eagerly and the same step under torch.compile
LOSS_TOLERANCE = 2e-3


def test_begin_without_wait_is_busy_while_another_process_leads(store_url: str) -> None:
    leader = Store.open(StoreSettings(store_url, namespace="busy"))
    other = Store.open(StoreSettings(store_url, namespace="busy"))
    with leader.begin("k") as flight:
        assert flight.role is Role.LEADER
        busy = other.begin("k", wait=False, wait_timeout=600)  # answered at once, not after the timeout
        assert busy.role is Role.BUSY and busy.data is None and busy.lease is None
        assert other.compiling("k")
        flight.publish(b"artifact")
    assert not other.compiling("k")
    again = other.begin("k", wait=False)
    assert again.role is Role.HIT and again.data == b"artifact"
    assert other.stats()["busy"] == 1 and other.stats()["waits"] == 0


def _env_without_recipecache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}


def test_bad_no_stall_variable_is_one_line_and_status_2(tmp_path: Path) -> None:
    env = _env_without_recipecache() | {"RECIPECACHE_NO_STALL": "yes"}
    proc = subprocess.run([sys.executable, "-m", "launcher.main", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                           str(TRAIN)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "RECIPECACHE_NO_STALL='yes'" in lines[0] and "1 (on) or 0 (off)" in lines[0]


def test_bad_no_stall_timeout_is_one_line_and_status_2(tmp_path: Path) -> None:
    env = _env_without_recipecache() | {"RECIPECACHE_NO_STALL_TIMEOUT": "soon"}
    proc = subprocess.run([sys.executable, "-m", "launcher.main", "--nproc", "1", "--no-stall", "--run-dir",
                           str(tmp_path / "run"), str(TRAIN)], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "RECIPECACHE_NO_STALL_TIMEOUT='soon'" in lines[0], proc.stderr


@pytest.mark.torch
@pytest.mark.internals
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_killed_worker_leaves_the_graph_eager_counted_then_retried(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # the metrics file rewritten at every change, as a user may ask: a flush reads no-stall's rows while
    # workers start and fail
    env = _env_without_recipecache() | {"RECIPECACHE_DIR": str(tmp_path / "store"),
                                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                                        "RECIPECACHE_METRICS_FILE": str(tmp_path / "metrics.json"),
                                        "RECIPECACHE_METRICS_FLUSH": "1"}
    proc = subprocess.run([sys.executable, str(WORKERS / "no_stall_kill.py"), str(out)], capture_output=True,
                          text=True, env=env, timeout=SCRIPT_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    no_stall = result["metrics"]["no_stall"]
    assert no_stall["failed"] >= 1 and no_stall["workers"] >= 2 and no_stall["retries"] >= 1
    assert json.loads((tmp_path / "metrics.json").read_text())["no_stall"]["failed"] == no_stall["failed"]
    assert result["metrics"]["fallbacks"].get("no_stall_failed") == no_stall["failed"]
    failed = [g for g in no_stall["graphs"].values() if g.get("failed")]
    assert failed and all(g["switched_at"] is not None for g in failed)  # compiled again, not eager for good
    assert all(g["eager_calls"] >= 5 for g in failed)  # it went on running without inductor meanwhile
    assert result["lease_freed"] == [True] * len(failed)  # another process may compile it
    assert "no_stall_failed" in proc.stderr  # the one warning


# -- a real job ------------------------------------------------------------------------
def _launch(tmp: Path, name: str, store_url: str, *args: str, launcher: tuple[str, ...] = ()) -> dict[str, Any]:
    """``args``: the training script's; ``launcher``: recipecache-run's besides those every job takes."""
    run_dir = tmp / name
    out = run_dir / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", store_url, "--namespace", "nostall",
         "--run-dir", str(run_dir), "--rank-dirs", str(tmp / f"{name}-dirs"), "--no-stall", *launcher, str(TRAIN),
         *args,
         "--out", str(out)],
        check=False, capture_output=True, text=True, env=_env_without_recipecache(), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {**json.loads(out.read_text()), "events": list(read_events(run_dir / "events")),
            "report": json.loads((run_dir / "report.json").read_text()),
            "metrics": [json.loads((run_dir / f"metrics-rank{r}.json").read_text()) for r in range(RANKS)]}


def _plain(tmp: Path, steps: int) -> dict[str, Any]:
    local = tmp / "plain-local"
    (local / "tmp").mkdir(parents=True)
    env = _env_without_recipecache() | {"TMPDIR": str(local / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"),
                                        "OMP_NUM_THREADS": "1"}
    out = tmp / "plain.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), str(TRAIN),
                           "--steps", str(steps), "--pause", "0", "--set-globals", "--out", str(out)],
                          check=False, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nostall")
    store = f"file://{tmp / 'store'}"
    cold = _launch(tmp, "cold", store, "--until-switched", str(UNTIL_SWITCHED_S), "--set-globals")
    fresh = _launch(tmp, "fresh", store, "--steps", "4", "--set-globals")
    yield {"cold": cold, "fresh": fresh, "plain": _plain(tmp, cold["steps"])}


def _events(job: dict[str, Any], kind: str, rank: int | None = None) -> list[dict[str, Any]]:
    return [e for e in job["events"] if e["event"] == kind and (rank is None or e["rank"] == rank)]


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_ranks_run_eager_while_a_worker_compiles_then_switch(jobs: dict[str, dict[str, Any]]) -> None:
    from recipecache.torch_integration.no_stall.controller import AWAITING_SUFFIX

    cold = jobs["cold"]
    no_stall = Counter(e["key"] for e in _events(cold, "compile") if e.get("behind"))
    assert no_stall and max(no_stall.values()) == 1, f"graphs compiled more than once: {no_stall}"
    assert not [e for e in _events(cold, "compile") if not e.get("behind")], "a rank compiled inline"
    most_compiled_by_one_worker = 0
    assert cold["report"]["total"]["compiles"] == 0  # no step waited for a compile
    for rank in range(RANKS):
        # a backward whose forward is compiled behind runs eagerly under a key of its own until that forward is
        # loaded (traced then on its layouts, and compiled under its own key)
        eager = {e["key"] for e in _events(cold, "eager", rank) if not e["key"].endswith(AWAITING_SUFFIX)}
        awaited = {e["key"] for e in _events(cold, "eager", rank) if e["key"].endswith(AWAITING_SUFFIX)}
        switched = {e["key"]: e["time"] for e in _events(cold, "switch", rank)}
        assert eager and eager == set(switched) == set(no_stall), f"rank {rank}"
        assert awaited and len(awaited) < len(eager), f"rank {rank}: {awaited}"
        for e in _events(cold, "eager", rank):
            if e["key"] in switched:
                assert e["time"] <= switched[e["key"]]  # eager until the switch, compiled after it
        # rank r compiles what it met first; the graphs another rank compiled it ran eagerly meanwhile
        compiled_here = {e["key"] for e in _events(cold, "compile", rank)}
        assert compiled_here and eager - compiled_here
        row = cold["metrics"][rank]["no_stall"]
        assert row["failed"] == 0 and row["switches"] == len(no_stall)
        assert row["workers"] == 1 and row["compiles"] == len(compiled_here)  # one worker compiled them all
        most_compiled_by_one_worker = max(most_compiled_by_one_worker, len(compiled_here))
    assert most_compiled_by_one_worker > 1


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_a_graph_whose_worker_died_is_taken_over_by_another_rank(tmp_path: Path) -> None:
    job = _launch(tmp_path, "takeover", f"file://{tmp_path / 'store'}", "--until-switched", str(UNTIL_SWITCHED_S), "--kill-worker")
    zero, one = (job["metrics"][rank]["no_stall"] for rank in range(RANKS))
    failed = {key for key, graph in zero["graphs"].items() if graph.get("failed")}
    assert failed and zero["failed"] == len(failed) and one["failed"] == 0
    # once rank 1 published it, rank 0 loads it: it does not stay eager for the rest of the job
    assert all(zero["graphs"][key]["switched_at"] is not None for key in failed)
    compiled = Counter(e["key"] for e in _events(job, "compile") if e.get("behind"))
    assert max(compiled.values()) == 1, f"graphs compiled more than once: {compiled}"
    assert failed <= {e["key"] for e in _events(job, "compile_start", 1)}, "rank 1 led what rank 0's worker left"
    # compiled by rank 1's worker, or (queued behind it) through the compile pool by an idle one: rank 0's new worker
    assert failed <= {e["key"] for e in _events(job, "compile", 1)} | {
        e["key"] for e in _events(job, "compile", 0) if e.get("taken")
    }
    assert failed <= {e["key"] for e in _events(job, "switch", 1)}, "and switched to it"
    assert len(job["losses"]) == job["steps"] and all(loss == loss for step in job["losses"] for loss in step)


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_an_idle_rank_compiles_the_graphs_queued_behind_a_busy_one(tmp_path: Path) -> None:
    # rank 0 alone evaluates at three lengths: graphs rank 1 never meets queue behind rank 0's worker. It starts
    # once rank 1 runs all its own graphs compiled: rank 1's worker is idle then, whatever the compiles take (when
    # both began together, rank 0's worker once claimed its last graph 0.1 s before rank 1's went idle)
    job = _launch(tmp_path, "pool", f"file://{tmp_path / 'store'}", "--until-switched", str(UNTIL_SWITCHED_S),
                  "--rank0-eval", "20,24,28", "--eval-once-others-switched")
    zero, one = (job["metrics"][rank]["no_stall"] for rank in range(RANKS))
    taken = {e["key"] for e in _events(job, "compile", 1) if e.get("taken")}
    assert taken and one["pool_taken"] == len(taken), "rank 1's idle worker compiled none of rank 0's graphs"
    assert zero["pool_handed"] == len(taken) and zero["pool_takeovers"] == 0 and zero["failed"] == one["failed"] == 0
    led_by_zero = {e["key"] for e in _events(job, "compile_start", 0)}
    assert taken <= led_by_zero  # graphs rank 0 led, compiled by rank 1 for it
    assert taken <= {e["key"] for e in _events(job, "switch", 0)}  # and rank 0 runs them compiled
    compiled = Counter(e["key"] for e in _events(job, "compile") if e.get("behind"))
    assert max(compiled.values()) == 1, f"graphs compiled more than once: {compiled}"
    assert led_by_zero <= set(compiled)  # every graph rank 0 led was compiled, here or there
    balance = job["report"]["total"]["compile_balance"]
    assert balance is not None and balance["largest_s"] > 0
    assert len(job["losses"]) == job["steps"] and all(loss == loss for step in job["losses"] for loss in step)


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_a_rank_that_finished_compiles_the_graphs_queued_behind_another_at_exit(tmp_path: Path) -> None:
    """Issue 47: a finished process takes work. One step, then the job ends: rank 1's script is over long before its
    own compiles behind are (so whatever it takes, it takes in its exit grace), while rank 0's three evaluation
    graphs queue behind its worker. Rank 1 compiles some of them for it, every graph is published within the grace,
    and none is compiled twice."""
    job = _launch(tmp_path, "exit-pool", f"file://{tmp_path / 'store'}", "--steps", "1", "--pause", "0",
                  "--rank0-eval", "20,24,28", launcher=("--exit-grace", "1200"))
    zero, one = (job["metrics"][rank]["no_stall"] for rank in range(RANKS))
    assert one["pool_taken"] >= 1 and zero["pool_handed"] == one["pool_taken"], (zero, one)
    assert zero["unfinished"] == one["unfinished"] == 0 and zero["failed"] == one["failed"] == 0
    compiled = Counter(e["key"] for e in _events(job, "compile") if e.get("behind"))
    assert max(compiled.values()) == 1, f"graphs compiled more than once: {compiled}"
    assert {e["key"] for e in _events(job, "compile_start", 0)} <= set(compiled)


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_losses_match_plain_torchrun(jobs: dict[str, dict[str, Any]]) -> None:
    cold, plain = jobs["cold"], jobs["plain"]
    assert len(cold["losses"]) == len(plain["losses"]) == cold["steps"]
    worst = max(abs(a - b) for step, ref in zip(cold["losses"], plain["losses"]) for a, b in zip(step, ref))
    assert worst <= LOSS_TOLERANCE


@pytest.mark.multirank
@pytest.mark.timeout(1800)
def test_fresh_ranks_after_compile_nothing(jobs: dict[str, dict[str, Any]]) -> None:
    fresh = jobs["fresh"]
    assert not _events(fresh, "compile") and not _events(fresh, "eager")
    assert len({e["key"] for e in _events(fresh, "hit")}) == len({e["key"] for e in _events(jobs["cold"], "switch")})
    # the cold ranks saved AOTAutograd's entries naming the graphs compiled behind when they switched to them: no
    # fresh rank traces a graph through AOTAutograd again before its FX lookup
    aot = [metrics["lookups"]["aot"] for metrics in fresh["metrics"]]
    assert all(lookups["hit"] >= 1 and lookups["miss"] == 0 for lookups in aot), aot


# -- the switching callable on its own ------------------------------------------------------
def _no_stall_graph(reload: Any) -> tuple[Any, Any, Any]:
    import torch
    from concurrent.futures import Future

    from recipecache.torch_integration import patches
    from recipecache.torch_integration.deferral import Deferred
    from recipecache.torch_integration.no_stall.controller import NoStall
    from recipecache.torch_integration.metrics import Metrics

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x * 2,)

    store = Store.open(StoreSettings("memory://", namespace="behind-unit"))
    no_stall = NoStall(store, Metrics(store, None, flush=False), 10.0, 600.0, hook_up=patches.hooked_for_worker)
    job: Future[float] = Future()
    graph = no_stall.graph(
        Deferred("k", ("f", "f32[2]"), job, {}, None), lambda _inputs: reload(), torch.fx.symbolic_trace(Double()), []
    )
    return graph, job, no_stall


@pytest.mark.torch
def test_a_backward_run_without_inductor_takes_saved_tensors_in_the_compiled_forwards_layout() -> None:
    """A backward runs without inductor while its forward already runs compiled (switched first, or loaded by a fresh
    process from the store): the tensors it gets come in inductor's layout, not the one AOTAutograd traced it on,
    and its ``view`` failed ("view size is not compatible", torchvision's ResNet: the training step raised). The
    backward's eager copy reshapes; the graph compiled and keyed stays as traced."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from recipecache.torch_integration.deferral import Deferred

    def backward_like(saved: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.ops.aten.view.default(saved, [6]) * 2,)

    gm = make_fx(backward_like)(torch.ones(2, 3))  # traced on a contiguous saved tensor
    inductors_layout = torch.arange(6.0).reshape(3, 2).t()  # the same values, transposed strides
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(inductors_layout)
    _, _, no_stall = _no_stall_graph(lambda: None)
    deferred = Deferred("k-bw", ("f backward", "f32[2,3]"), None, {}, None)
    graph = no_stall.graph(deferred, lambda _inputs: None, gm, [torch.ones(2, 3)], backward=True)
    assert torch.equal(graph([inductors_layout])[0], inductors_layout.reshape(6) * 2)
    assert any(n.target is torch.ops.aten.view.default for n in gm.graph.nodes), "the traced graph is untouched"


@pytest.mark.torch
def test_inputs_laid_out_otherwise_than_traced_are_copied_into_the_traced_layout() -> None:
    """What a graph compiled behind asserts of its inputs is the layout they were traced with: static strides
    exactly, symbolic ones (a dynamic graph) by the order of the dims in memory; inputs in that layout pass as they
    are."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from recipecache.torch_integration.no_stall.graph import TracedLayouts

    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    traced_dynamic = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.ones(2, 3, 4, 5),
                                                                        symbolic_context=dynamic)
    assert not all(isinstance(stride, int) for stride in traced_dynamic.stride())
    layouts = TracedLayouts([torch.ones(2, 3, 4, 5), 7, traced_dynamic, torch.ones(3, 1).expand(3, 4)])
    channels_last = torch.arange(120.0).reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    bigger = torch.arange(360.0).reshape(2, 3, 6, 10).contiguous(memory_format=torch.channels_last)
    args = [channels_last, 7, bigger, torch.ones(3, 4)]
    assert layouts.restride(args) == 2  # not the broadcast view's input: no copy can be one
    assert args[0].stride() == (60, 20, 5, 1) and torch.equal(args[0], channels_last)
    assert args[2].is_contiguous() and torch.equal(args[2], bigger)
    assert layouts.restride(args) == 0  # in the traced layouts now: nothing copied


@pytest.mark.torch
def test_switching_callable_runs_eager_until_its_compile_is_done_then_compiled() -> None:
    import torch

    loads: list[int] = []

    def reload() -> Any:
        loads.append(1)
        return lambda args: ("compiled", len(args))

    graph, job, no_stall = _no_stall_graph(reload)
    assert graph._boxed_call is True
    for _ in range(3):
        assert torch.equal(graph([torch.ones(2)])[0], torch.full((2,), 2.0))
    assert not loads  # the compile is not done: never tried
    job.set_result(1.0)
    assert graph([torch.ones(2)]) == ("compiled", 1) and graph([torch.ones(2)]) == ("compiled", 1)
    assert loads == [1]  # loaded once, then called
    row = no_stall.snapshot()["k"]
    assert row["eager_calls"] == 3 and row["switched_at"] is not None
    assert no_stall.metrics.snapshot()["no_stall"]["switches"] == 1


@pytest.mark.torch
def test_switching_callable_stays_eager_when_its_compile_failed_or_its_load_fails() -> None:
    import torch

    def never() -> Any:
        raise AssertionError("a failed compile is not loaded")

    graph, job, _ = _no_stall_graph(never)
    job.set_exception(RuntimeError("worker exited with status -9"))
    for _ in range(2):
        assert torch.equal(graph([torch.ones(2)])[0], torch.full((2,), 2.0))

    def broken() -> Any:
        raise OSError("the artifact's kernel is gone")

    graph, job, no_stall = _no_stall_graph(broken)
    job.set_result(1.0)
    for _ in range(2):
        assert torch.equal(graph([torch.ones(2)])[0], torch.full((2,), 2.0))
    metrics = no_stall.metrics.snapshot()
    assert metrics["no_stall"]["failed"] == 1 and metrics["fallbacks"] == {"no_stall_failed": 1}
    assert "cannot load the compiled graph" in no_stall.snapshot()["k"]["failed"]


@pytest.mark.torch
def test_what_waits_for_a_graphs_load_runs_at_its_switch_or_at_exit_where_it_is_published() -> None:
    """AOTAutograd's entry naming a graph compiled behind waits for its load (the entry names the compiled graph's
    key): it is saved at the switch; a graph published after the script ended (a short job) is loaded at exit for
    it, where it is there: never one whose compile failed or is still running, never compiled at exit."""
    import torch

    graph, job, no_stall = _no_stall_graph(lambda: _Compiled())
    saved: list[str] = []
    assert graph.when_loaded(lambda: saved.append(graph._fx_graph_cache_key))
    assert graph._fx_graph_cache_key is None and graph.awaits_load()  # what AOTAutograd reads: nothing yet
    job.set_result(1.0)
    graph([torch.ones(2)])  # the switch
    assert saved == ["fx-key"] and not graph.awaits_load() and not graph.when_loaded(lambda: None)

    at_exit, job, no_stall = _no_stall_graph(lambda: _Compiled())
    at_exit.when_loaded(lambda: saved.append("at exit"))
    running, _, _ = _no_stall_graph(lambda: _Compiled())
    failed, failed_job, _ = _no_stall_graph(lambda: _Compiled())
    failed_job.set_exception(RuntimeError("worker exited with status -9"))
    for waiting in (running, failed):
        waiting.when_loaded(lambda: saved.append("never"))
        assert not waiting.load_at_exit()
    job.set_result(1.0)  # published in the exit grace: no call switches to it
    no_stall._load_at_exit(float("inf"))
    assert saved == ["fx-key", "at exit"] and no_stall.snapshot()["k"]["switched_at"] is None
    assert no_stall.metrics.snapshot()["no_stall"]["switches"] == 0  # a load at exit is no switch


@pytest.mark.torch
def test_an_entry_pairing_a_forward_laid_out_otherwise_than_traced_is_never_saved() -> None:
    """The backward of a forward compiled behind was traced on the forward's eager layouts: AOTAutograd's entry
    pairing them is saved only where the compiled forward lays its outputs out as traced, never where inductor chose
    others (a next process would load a backward that rejects the forward's outputs)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from recipecache.torch_integration.deferral import Deferred, save_when_loaded

    def forward(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * 2,)

    gm = make_fx(forward)(torch.ones(2, 3))  # its output traced contiguous: strides (3, 1)
    _, _, no_stall = _no_stall_graph(lambda: None)
    for compiled_strides, fits in (([("3", "1")], True), ([("1", "2")], False)):
        compiled = _Compiled()
        compiled.output_strides = compiled_strides  # type: ignore[attr-defined]  # as inductor writes them
        graph = no_stall.graph(Deferred("k-fw", ("f", "f32[2,3]"), None, {}, None), lambda _inputs: compiled, gm,
                               [torch.ones(2, 3)])
        saved: list[str] = []
        save_when_loaded(lambda: saved.append("entry"), [graph])
        graph.load_at_exit()
        assert graph.fits_its_entry() is fits and saved == (["entry"] if fits else [])


@pytest.mark.torch
def test_a_graph_that_misses_while_loading_at_exit_is_deferred_never_compiled() -> None:
    """The load at exit runs torch's compile again, which hits where the graph is published; a miss there (an entry
    gone, a store down) must not compile the graph inline as the process exits: it is deferred, its lease freed."""
    from recipecache.torch_integration.deferral import Deferred

    _, _, no_stall = _no_stall_graph(lambda: None)
    leader = no_stall.store.begin("k-exit", wait=False)
    assert leader.role is Role.LEADER
    no_stall._loading_at_exit = True
    deferred = no_stall.intercept(leader, ("f", "f32[2]"), (None, [], []), {})
    assert isinstance(deferred, Deferred) and deferred.job is None
    assert not no_stall.store.compiling("k-exit")  # released: another process may compile it
    assert isinstance(no_stall.intercept(None, ("f", "f32[2]"), (None, [], []), {}), Deferred)


@pytest.mark.torch
def test_each_backward_awaits_the_forward_of_its_own_compile_in_a_shared_tracing_context() -> None:
    """DDP's optimizer compiles one graph per bucket, each forward then its backward stage, all in one tracing
    context; the backwards are compiled later, in reverse order. Each must await the forward of its own compile
    (a stage bound to the context's last forward paired the first bucket's backward with the second's forward, and
    torchvision's fresh no-stall job compiled that backward again), found by the tensors it is compiled on; a
    backward whose forward was not compiled behind awaits nothing."""
    import torch

    from recipecache.torch_integration.deferral import Deferred

    def bw_module(*values: Any) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        for index, value in enumerate(values):
            graph.placeholder(f"saved_{index}").meta["val"] = value
        graph.output(())
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    def stage(**arguments: Any) -> None:
        raise AssertionError("not run in this test")

    _, _, no_stall = _no_stall_graph(lambda: None)
    context = torch._guards.TracingContext(None)
    context.output_strides = []  # as in AOTAutograd's forward compile (report_output_strides)
    saved = [[torch.ones(2), torch.ones(3)], [torch.ones(4)], [torch.ones(5)]]
    forwards = []
    with torch._guards.tracing(context):
        for bucket, tensors in enumerate(saved):
            if bucket < 2:  # the third bucket's forward was a hit: its compile reported strides
                deferred = Deferred(f"fw-{bucket}", ("f", ""), None, {}, context)
                identity = torch.fx.symbolic_trace(torch.nn.Identity())
                forwards.append(no_stall.graph(deferred, lambda _inputs: None, identity, []))
            reported = [] if bucket < 2 else [(1,)]
            no_stall.backward_stage(stage, {"bw_module": bw_module(*tensors), "fwd_output_strides": reported})
        assert no_stall._awaits_its_forward([torch.ones(5)]) is None, "not a kept stage's tensors"
        for bucket in (2, 1, 0):  # backwards compile in reverse order
            found = no_stall._awaits_its_forward([*saved[bucket], torch.ones(1)])  # and the gradients of outputs
            assert (found and found.forward) is (forwards[bucket] if bucket < 2 else None)
        assert no_stall._awaits_its_forward(saved[0]) is None, "each stage is taken once"


@pytest.mark.torch
def test_a_backward_awaiting_its_forward_is_compiled_on_the_requires_grad_it_met() -> None:
    """DDP's optimizer sets ``requires_grad`` on the tensor a bucket's graph hands the next one, after the first
    bucket's backward met it: a backward traced again later must see what it met (the key holds it), or its key is
    not the one a fresh process computes (torchvision's dynamic backward compiled again). The alias has the
    tensor's sizes and strides."""
    import torch

    from recipecache.torch_integration.no_stall.graph import _requiring_grad

    met = torch.ones(2, 3).t()
    later = met.requires_grad_(True)
    alias = _requiring_grad(later, False)
    assert not alias.requires_grad and alias.stride() == (1, 3) and alias.data_ptr() == met.data_ptr()
    assert _requiring_grad(later, True) is later and _requiring_grad(3, False) == 3


class _Compiled:
    """A loaded graph as torch's FX cache gives it: callable, with the key AOTAutograd's entry names."""

    _fx_graph_cache_key = "fx-key"

    def __call__(self, args: list[Any]) -> tuple[str]:
        return ("compiled",)


# -- guards, deadlines, exit, the job's input -------------------------------------------------
def _run_script(tmp_path: Path, script: str, *args: str, extra_env: dict[str, str] | None = None,
                timeout: float = SCRIPT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = _env_without_recipecache() | {"RECIPECACHE_DIR": str(tmp_path / "store"),
                                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **(extra_env or {})}
    return subprocess.run([sys.executable, str(WORKERS / script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


@pytest.mark.torch
@pytest.mark.internals
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_switched_graph_runs_only_for_inputs_inductors_guards_accept(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _run_script(tmp_path, "no_stall_guards.py", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert max(result["differences"].values()) <= 1e-5, result["differences"]
    no_stall = result["metrics"]["no_stall"]
    assert no_stall["failed"] == 0 and no_stall["switches"] >= 1
    assert no_stall["guard_rejected"] >= 1  # inductor's guard held a length off the specialized graph


@pytest.mark.torch
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_conv_nets_backward_is_compiled_on_its_compiled_forwards_layouts(tmp_path: Path) -> None:
    """A conv net (CPU: inductor lays activations and weights out channels-last) trains on once its forward and
    backward both run compiled, and a fresh process then compiles nothing. The backward is compiled once its forward
    compiled behind is loaded, traced on that forward's layouts as torch traces it after a hit: traced on eager's
    (the forward ran without inductor), it raised in ``assert_size_stride`` the step after the switch, and a fresh
    process, whose forward hits, traced it under another key and compiled it again (torchvision's and diffusers'
    fresh no-stall jobs in the corpus)."""
    cold, fresh = tmp_path / "cold.json", tmp_path / "fresh.json"
    proc = _run_script(tmp_path, "no_stall_conv.py", str(cold))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(cold.read_text())
    no_stall = result["metrics"]["no_stall"]
    assert no_stall["failed"] == 0 and no_stall["switches"] == len(no_stall["graphs"]) == 2, no_stall
    assert result["worst"] <= LOSS_TOLERANCE
    proc = _run_script(
        tmp_path, "no_stall_conv.py", str(fresh), extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh")}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(fresh.read_text())["metrics"]
    assert metrics["store"]["compiles"] == 0 and not metrics["no_stall"]["graphs"], metrics["no_stall"]
    assert metrics["lookups"]["aot"] == {"hit": 1, "miss": 0, "put": 0}, metrics["lookups"]  # the pair's entry


@pytest.mark.torch
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_stuck_compile_behind_is_ended_at_its_deadline(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _run_script(tmp_path, "no_stall_stuck.py", "deadline", str(out), extra_env={"RECIPECACHE_NO_STALL_TIMEOUT": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["metrics"]["fallbacks"] == {"no_stall_timeout": 1}
    assert result["metrics"]["no_stall"]["failed"] == 1
    assert not result["still_leased"] and not result["worker_exists"]


@pytest.mark.torch
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_exit_grace_ends_a_stuck_compile_behind(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    try:  # the grace is 1 s: past the bound, the exit hung on the stuck worker
        proc = _run_script(tmp_path, "no_stall_stuck.py", "exit", str(out))
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: a stuck compile behind held it past the exit grace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert not Path(f"/proc/{result['worker']}").exists()
    store = Store.open(StoreSettings(f"file://{tmp_path / 'store'}"))
    assert not store.compiling(result["key"])


def _no_stall_with_jobs(tmp_path: Path, keys: list[str], secret: bytes | None = None) -> tuple[Any, Store]:
    """A NoStall on a filesystem store whose worker gets one job per key, leased here; a job torch cannot read
    (its wire input is not torch's), so the worker fails it after starting."""
    import pickle

    from recipecache.torch_integration import patches
    from recipecache.torch_integration.no_stall import global_state
    from recipecache.torch_integration.no_stall.controller import NoStall
    from recipecache.torch_integration.metrics import Metrics

    store = Store.open(StoreSettings(f"file://{tmp_path / 'store'}", namespace="jobs", secret=secret))
    no_stall = NoStall(store, Metrics(store, None, flush=False), 10.0, 600.0, hook_up=patches.hooked_for_worker)
    for key in keys:
        flight = store.begin(key, wait=False)
        assert flight.role is Role.LEADER
        no_stall._row(key, ("f", "f32[2]"))
        no_stall._submit(flight, pickle.dumps("not a graph"), global_state.capture())
    return no_stall, store


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_finish_frees_the_lease_of_a_compile_still_queued(tmp_path: Path) -> None:
    no_stall, store = _no_stall_with_jobs(tmp_path, ["first", "queued"])
    no_stall.finish(0.0)
    assert not store.compiling("first") and not store.compiling("queued")
    # what was ended is counted and said as ended at exit (nothing published), not as a failed compile
    rows = no_stall.snapshot()
    unfinished = [key for key, row in rows.items() if "unfinished" in row]
    assert unfinished and all("failed" in row for key, row in rows.items() if key not in unfinished), rows
    assert all("failed" not in rows[key] and "nothing published" in rows[key]["unfinished"] for key in unfinished)
    fallbacks = no_stall.metrics.snapshot()["fallbacks"]
    assert fallbacks.get("no_stall_unfinished") == len(unfinished), fallbacks


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_an_exit_grace_past_what_a_wait_takes_lets_the_compile_finish(tmp_path: Path) -> None:
    no_stall, _ = _no_stall_with_jobs(tmp_path, ["k"])
    no_stall.finish(1e10)  # beyond threading.TIMEOUT_MAX: the compile ends on its own (here, failing to read its job)
    failed = no_stall.snapshot()["k"]["failed"]
    assert "exited with status" not in failed, failed  # the worker answered; it was not killed


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_compile_behind_writes_nothing_to_the_temporary_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable and not sticky: another user could swap whatever we put there
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    secret = b"s3cret-signing-key-0123456789abcdef"
    no_stall, _ = _no_stall_with_jobs(tmp_path, ["k"], secret=secret)
    try:
        assert list(shared.iterdir()) == []  # the job (and the secret in its settings) went through the worker's pipe
    finally:
        no_stall.finish(0.0)


@pytest.mark.torch
@pytest.mark.redis
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_store_outage_during_a_compile_behind_still_switches_the_leader(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    (tmp_path / "redis").mkdir()
    proc = _run_script(tmp_path, "no_stall_outage.py", str(tmp_path / "redis"), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    no_stall = result["metrics"]["no_stall"]
    assert no_stall["failed"] == 0 and no_stall["compiles"] == 1 and no_stall["switches"] == 1
    assert "backend_down" in result["metrics"]["fallbacks"]  # the worker's store failures, counted here
    assert result["difference"] <= 1e-6
