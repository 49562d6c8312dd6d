"""No-stall's worker compiles under the rank's global torch state, and a failed compile behind is not the end.

* each setting a training script makes before it compiles (matmul and cuDNN precisions, deterministic
  algorithms, default dtype, inductor/functorch/dynamo/compiler config changed at run time, thread
  count, environment), captured in a "rank" process and applied in one kept "worker" process after the other (or, where
  an earlier state stuck, in a fresh one, as no-stall does): the worker computes the rank's FX key for each
  (and the key-relevant ones do change the key);
* every config module loaded travels (``torch.fx.experimental._config`` did not: issue 44);
* a config torch's copy leaves out (a custom pass) cannot travel: :class:`Uncarried`;
* a kept worker in which an earlier job's state stuck is replaced for the job;
* the lead policy after a failure: the lease left to the others, led again only after a look and a
  wait, inline after a key mismatch, at most ``NO_STALL_TRIES`` times;
* a graph whose compile failed switches once another process published it (issue 28: load, never lead);
* a real compile whose worker answers a key mismatch: counted, compiled again inline, switched.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from recipecache.reasons import Role
from recipecache.settings import StoreSettings
from recipecache.store import Store
from support.hang_guard import SCRIPT_TIMEOUT_S, TEST_TIMEOUT_S
from harness.paths import WORKERS

pytestmark = pytest.mark.internals

STATE_KEY = WORKERS / "state_key.py"

#: statements a training script runs before it compiles, and whether torch's FX key reads what they set
#: (the others only inductor's lowering reads, or dynamo: the worker reproduces them all the same)
SETTINGS = {
    "torch.backends.cuda.matmul.allow_tf32 = True": True,
    "torch.backends.cudnn.allow_tf32 = False": False,
    "torch.set_float32_matmul_precision('high')": True,
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": True,
    "torch.backends.cuda.matmul.allow_tf32 = True; torch.set_float32_matmul_precision('medium')": True,
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False": True,
    "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'": False,
    "torch.use_deterministic_algorithms(True, warn_only=True)": True,
    "torch.utils.deterministic.fill_uninitialized_memory = False": True,
    "torch.set_default_dtype(torch.float64)": True,
    "torch.set_num_threads(1)": True,
    "torch._inductor.config.fallback_random = True": True,
    "torch._inductor.config._micro_pipeline_tp = True": True,
    "torch._functorch.config.bundled_autograd_cache = True": True,
    "torch.compiler.config.cache_key_tag = 'job-tag'": True,
    "torch._dynamo.config.capture_scalar_outputs = True": False,
    "os.environ['SCRIPT_SETTING'] = '1'; os.environ.pop('HOME', None)": False,
}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}


@pytest.mark.torch
@pytest.mark.timeout(900)
def test_the_worker_computes_the_ranks_key_under_each_setting() -> None:
    statements = ["pass", *SETTINGS]
    ranks = [subprocess.Popen([sys.executable, str(STATE_KEY), "rank", s], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env()) for s in statements]
    captured: list[dict[str, Any]] = []
    for statement, proc in zip(statements, ranks):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{statement}: {err.decode()[-2000:]}"
        captured.append(pickle.loads(out))
    # one worker process for all, as the kept worker: each state replaces the previous one, defaults included;
    # where what stuck of an earlier state keeps it from reproducing one, a fresh worker gets that job (as no-stall does)
    results = _in_worker([c["state"] for c in captured])
    for index, result in enumerate(results):
        if result["differences"] and index:
            results[index] = _in_worker([captured[index]["state"]])[0]
    default_key = captured[0]["key"]
    for statement, rank, worker_side in zip(statements, captured, results):
        assert worker_side["differences"] == [], statement
        assert worker_side["key"] == rank["key"], statement
        if SETTINGS.get(statement):
            assert rank["key"] != default_key, f"{statement} does not change the key: the test proves nothing"


def _in_worker(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Apply each state, one after the other, in one fresh process; the FX key and unreproduced names after each."""
    worker = subprocess.run([sys.executable, str(STATE_KEY), "worker"], input=pickle.dumps(states),
                            capture_output=True, env=_env(), timeout=600, check=False)
    assert worker.returncode == 0, worker.stderr.decode()[-2000:]
    results: list[dict[str, Any]] = pickle.loads(worker.stdout)
    return results


@pytest.mark.torch
def test_every_config_module_travels_to_the_worker() -> None:
    """Issue 44 item 4: inductor reads ``torch.fx.experimental._config.backed_size_oblivious`` (``sizevars``), which
    neither travelled (a hand list of five config modules) nor is in torch's FX key: the worker compiled under
    its default, not the rank's value, under the rank's key. Every config module loaded travels now (the test
    finds them itself), and a state that holds the rank's value is reproduced and checked."""
    import sys

    import torch.fx.experimental._config as fx_config
    from torch.utils._config_module import ConfigModule

    from recipecache.torch_integration.no_stall import global_state

    loaded = {name for name, m in list(sys.modules.items()) if isinstance(m, ConfigModule) and "testing" not in name}
    assert {"torch.fx.experimental._config", "torch._export.config", "torch.distributed.config"} <= loaded
    with fx_config.patch(backed_size_oblivious=True):
        rank = global_state.capture()
    assert loaded <= set(rank["configs"])
    assert global_state.differences(rank) == ["torch.fx.experimental._config.backed_size_oblivious"]
    try:
        global_state.apply(rank)  # what the worker does with the rank's state
        assert fx_config.backed_size_oblivious is True and global_state.differences(rank) == []
    finally:
        fx_config.backed_size_oblivious = False


@pytest.mark.torch
@pytest.mark.timeout(900)
def test_a_worker_elsewhere_computes_the_ranks_graph_store_key_under_backed_size_oblivious(tmp_path: Path) -> None:
    """Issue 44 item 4, across processes: a rank sets ``backed_size_oblivious`` (outside torch's FX key, so the
    graph store's key holds it); a worker started in another directory, as no-stall's is, reproduces it and
    computes the rank's store key. Before: the value did not travel (the worker compiled under its default);
    dynamo's ``debug_dir_root`` (a per-directory default) must not tell the two apart either."""
    statement = "import torch.fx.experimental._config as c; c.backed_size_oblivious = True"
    ranks = []
    for s in ("pass", statement):
        proc = subprocess.run([sys.executable, str(STATE_KEY), "rank", s], capture_output=True, env=_env(),
                              timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        ranks.append(pickle.loads(proc.stdout))
    default, oblivious = ranks
    assert oblivious["settings"] != default["settings"]
    worker = subprocess.run([sys.executable, str(STATE_KEY), "worker"], input=pickle.dumps([oblivious["state"]]),
                            capture_output=True, env=_env() | {"PYTHONPATH": os.pathsep.join(sys.path)},
                            cwd=tmp_path, timeout=600, check=False)
    assert worker.returncode == 0, worker.stderr.decode()[-2000:]
    [result] = pickle.loads(worker.stdout)
    assert result["differences"] == [] and result["settings"] == oblivious["settings"]
    assert result["key"] == oblivious["key"]


@pytest.mark.torch
def test_a_custom_pass_cannot_travel_to_a_worker() -> None:
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from recipecache.torch_integration.no_stall import global_state

    class Noop(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> bytes:
            return b"noop"

    global_state.capture()  # torch's defaults travel
    with inductor_config.patch(post_grad_custom_post_pass=Noop()), pytest.raises(global_state.Uncarried) as raised:
        global_state.capture()
    assert "post_grad_custom_post_pass" in str(raised.value)


@pytest.mark.torch
def test_a_job_a_kept_worker_cannot_reproduce_runs_again_in_a_fresh_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from recipecache.torch_integration.no_stall.controller import _Job
    from recipecache.torch_integration.no_stall.pool import _Worker

    answers = [{"error": "the worker cannot reproduce the rank's float32_matmul_precision", "stale_worker": True},
               {"compile_s": 1.5}]
    workers: list[_Worker] = []

    def compile_(worker: _Worker, payload: bytes, timeout: float) -> dict[str, Any]:
        workers.append(worker)
        return answers.pop(0)

    monkeypatch.setattr(_Worker, "compile", compile_)
    no_stall = _no_stall(monkeypatch, retry_s=0.0)
    try:
        job = _Job("k", b"job", no_stall.store.begin("k", wait=False))
        assert no_stall._work(job.key, job.payload, lambda: job.cancelled) == 1.5
        assert len(workers) == 2 and workers[0] is not workers[1] and not workers[0].alive()
        assert no_stall.metrics.snapshot()["no_stall"]["workers"] == 2
    finally:
        no_stall.close()


def _no_stall(monkeypatch: pytest.MonkeyPatch, retry_s: float, url: str = "memory://") -> Any:
    from recipecache.torch_integration import patches
    from recipecache.torch_integration.no_stall import controller, graph
    from recipecache.torch_integration.metrics import Metrics

    monkeypatch.setattr(graph, "POLL_S", 0.0)
    monkeypatch.setattr(graph, "RETRY_S", retry_s)
    monkeypatch.setattr(controller, "RETRY_S", retry_s)
    store = Store.open(StoreSettings(url, namespace="behind-policy"))
    return controller.NoStall(store, Metrics(store, None, flush=False), 10.0, 600.0, hook_up=patches.hooked_for_worker)


@pytest.mark.torch
def test_a_graph_no_worker_can_compile_is_counted_inline_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph no worker can compile under this process's key (here: torch cannot serialize it; FSDP2 + TP's graphs
    run collectives on this process's groups) is compiled inline by design: counted ``no_stall_inline``, never a
    failed compile behind (the corpus's FSDP2 + TP job reported six ``no_stall_failed`` that were no failures)."""
    no_stall = _no_stall(monkeypatch, retry_s=0.0)
    flight = no_stall.store.begin("k", wait=False)
    assert no_stall._sendable(flight, ("f", "f32[2]"), None) is None  # this process compiles it inline
    flight.release()
    metrics = no_stall.metrics.snapshot()
    assert metrics["no_stall"]["inline"] == 1 and metrics["no_stall"]["failed"] == 0
    assert metrics["fallbacks"] == {"no_stall_inline": 1}


@pytest.mark.torch
def test_a_failed_lead_is_retried_after_a_look_inline_after_a_key_mismatch_and_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from recipecache.torch_integration.no_stall.controller import NO_STALL_TRIES, WorkerFailed

    no_stall = _no_stall(monkeypatch, retry_s=0.0)
    store = no_stall.store
    first = store.begin("k", wait=False)
    assert no_stall._lead(first) == "worker"
    first.release()  # the job's end frees it
    no_stall._compile_failed("k", WorkerFailed("the worker computed key a, the rank b", inline=True, key_mismatch=True))
    flight = store.begin("k", wait=False)
    assert flight.role is Role.LEADER
    assert no_stall._lead(flight) is None  # not before it looked at the free lease: the others go first
    assert not store.compiling("k")  # and the lease it took is theirs to take
    no_stall.looked_after_failure("k")
    inline = store.begin("k", wait=False)
    assert no_stall._lead(inline) == "inline"  # a worker would compute the wrong key again
    inline.release()  # the inline compile's end frees it
    assert NO_STALL_TRIES == 2
    no_stall._compile_failed("k", RuntimeError("inline compile raised"))
    no_stall.looked_after_failure("k")
    assert no_stall._lead(store.begin("k", wait=False)) is None  # led twice: from now on it only waits
    assert not store.compiling("k")
    metrics = no_stall.metrics.snapshot()["no_stall"]
    assert metrics["retries"] == 1 and metrics["key_mismatches"] == 1


@pytest.mark.torch
def test_a_graph_whose_compile_failed_switches_once_another_process_publishes_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch
    from concurrent.futures import Future

    from recipecache.torch_integration.deferral import Deferred

    # this process will not lead it again during the test; the other process shares the store
    no_stall = _no_stall(monkeypatch, retry_s=3600.0, url=f"file://{tmp_path / 'store'}")
    other = Store.open(StoreSettings(no_stall.store.url, namespace="behind-policy"))

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x * 2,)

    loads: list[int] = []

    def reload() -> Any:
        loads.append(1)
        return lambda args: ("compiled", len(args))

    job: Future[float] = Future()
    graph = no_stall.graph(
        Deferred("k", ("f", "f32[2]"), job, {}, None), lambda _inputs: reload(), torch.fx.symbolic_trace(Double()), []
    )
    job.set_exception(RuntimeError("worker exited with status -9"))
    no_stall._compile_failed("k", RuntimeError("worker exited with status -9"))
    assert torch.equal(graph([torch.ones(2)])[0], torch.full((2,), 2.0))
    with other.begin("k", wait=False) as flight:  # another process compiles it
        assert flight.role is Role.LEADER
        for _ in range(3):
            assert torch.equal(graph([torch.ones(2)])[0], torch.full((2,), 2.0))
        assert not loads  # nothing to load while it compiles
        flight.publish(b"artifact")
    assert graph([torch.ones(2)]) == ("compiled", 1)  # its compile ended: this process loads it
    assert loads == [1] and no_stall.snapshot()["k"]["switched_at"] is not None


@pytest.mark.torch
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_key_mismatch_is_counted_and_the_graph_compiled_inline_then_switched(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = _env() | {"RECIPECACHE_DIR": str(tmp_path / "store"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run([sys.executable, str(WORKERS / "no_stall_inline.py"), str(out)], capture_output=True,
                          text=True, env=env, timeout=SCRIPT_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    no_stall = json.loads(out.read_text())["no_stall"]
    assert no_stall["key_mismatches"] == 1 and no_stall["failed"] == 1 and no_stall["retries"] == 1
    assert no_stall["compiles"] == 1  # the forward, behind; the backward was compiled inline
    rows = no_stall["graphs"].values()
    assert all(g["switched_at"] is not None for g in rows) and len(rows) == 2
    assert [g["name"] for g in rows if g.get("failed")] == ["inner backward"]


@pytest.mark.torch
def test_a_registered_backends_codegen_config_reaches_the_worker_and_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.15's wire format carries the codegen configs of the backends registered for a device
    (``backend_configs``; the FX key covers them), and torch's own child compiles under them. No-stall's wire
    input carries the rank's, and its worker's context applies them: under it, a process whose backend config
    reads its defaults computes the rank's FX key. Before, on 2.15 no-stall was off: the wire input lacked the
    field (building it raised)."""
    import importlib

    import torch
    from torch._inductor.codecache import compiled_fx_graph_hash
    from torch._inductor.codegen import common
    from torch._inductor.compile_fx_ext import _WireProtocolInput, _WireProtocolPickledInput
    from torch.fx.experimental.proxy_tensor import make_fx

    from recipecache.torch_integration.no_stall.protocol import wire_input
    from recipecache.torch_integration.no_stall.worker import compile_context

    if "backend_configs" not in _WireProtocolInput.__dataclass_fields__:
        pytest.skip(f"torch {torch.__version__}'s wire format carries no backend configs (from 2.15)")
    monkeypatch.syspath_prepend(str(WORKERS))
    backend: Any = importlib.import_module("backend_codegen_config")
    common.init_backend_registration()  # torch's own first, which registers the CPU without a codegen config
    monkeypatch.setitem(common.custom_backend_codegen_configs, "cpu", backend)

    inputs = [torch.randn(4, 3), torch.randn(3, 3)]
    gm = make_fx(lambda x, w: (torch.relu(x @ w),))(*inputs)
    default_key = compiled_fx_graph_hash(gm, inputs, {}, [])[0]
    backend.vector_width = 16  # the rank's setting
    rank_key = compiled_fx_graph_hash(gm, inputs, {}, [])[0]
    assert rank_key != default_key, "the backend config does not change the key: the test proves nothing"
    payload = wire_input(gm, inputs, [], {})
    assert payload is not None
    backend.vector_width = 8  # the worker's: a fresh process's defaults
    wire = _WireProtocolPickledInput(payload).deserialize()
    assert wire.backend_configs == {backend.__name__: backend.get_serializable_config_copy() | {"vector_width": 16}}
    with compile_context(wire):
        assert backend.vector_width == 16
        assert compiled_fx_graph_hash(wire.gm, wire.example_inputs, {}, [])[0] == rank_key
    assert backend.vector_width == 8


def _process_state(pid: int) -> str | None:
    """``pid``'s state letter from /proc (``T`` stopped, ``Z`` a zombie), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the worker's own process group needs Python 3.11's Popen")
def test_a_worker_stopped_before_it_asked_to_die_with_its_rank_ends_with_it(tmp_path: Path) -> None:
    """Issue 28: a worker stopped (SIGSTOP) before it armed its parent-death signal outlived its rank, killed
    meanwhile, stopped for good. Started in a process group of its own (in the rank's session), it is ended by
    the kernel once the rank's death leaves that group orphaned with a stopped member. It starts in the
    directory that holds the package (never the rank's, never the package's own)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    rank = subprocess.Popen([sys.executable, str(WORKERS / "stopped_worker.py")], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    try:
        assert rank.stdout is not None
        pid = int(rank.stdout.readline())
        assert os.getpgid(pid) == pid and os.getsid(pid) == rank.pid, "the worker's own group, in the rank's session"
        assert (Path(f"/proc/{pid}/cwd").resolve() / "recipecache" / "torch_integration").is_dir()
        deadline = time.monotonic() + 60  # a hang guard: the stop is delivered once the worker next runs
        while _process_state(pid) != "T":
            assert time.monotonic() < deadline, f"the worker never stopped (state {_process_state(pid)})"
            time.sleep(0.01)
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 60  # a hang guard: a worker stopped for good never ends
    while _process_state(pid) not in (None, "Z"):
        assert time.monotonic() < deadline, f"the worker outlived its rank (state {_process_state(pid)})"
        time.sleep(0.05)


@pytest.mark.torch
def test_a_graph_a_taker_compiled_before_its_turn_here_is_not_compiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile pool: when this process's worker gets to a graph it offered that a taker already compiled (the
    taker's claim released, its result written), the job ends as the taker's, and this worker compiles nothing."""
    from recipecache.compile_pool import CompilePool, Result
    from recipecache.torch_integration import patches
    from recipecache.torch_integration.metrics import Metrics
    from recipecache.torch_integration.no_stall import controller, graph
    from recipecache.torch_integration.no_stall.pool import _Worker

    monkeypatch.setattr(graph, "POLL_S", 0.0)
    monkeypatch.setattr(_Worker, "compile", lambda *args: pytest.fail("compiled again"))
    store = Store.open(StoreSettings("memory://", namespace="pool-policy"))
    no_stall = controller.NoStall(store, Metrics(store, None, flush=False), 10.0, 600.0,
                                  hook_up=patches.hooked_for_worker, compile_pool=CompilePool(store, member="r0"))
    try:
        job = controller._Job("k", b"job", store.begin("k", wait=False), offered=True)
        taker = CompilePool(store, member="r1")
        claim = taker.claim("k")
        assert claim is not None
        taker.report("k", Result(compiled=True, compile_s=4.0, by="r1"))
        claim.release()
        no_stall._start(job)
        assert job.future.result(timeout=30) == 0.0
        assert no_stall.metrics.snapshot()["no_stall"]["pool_handed"] == 1
        assert not store.compiling("k")  # the graph's lease is free: the others load it
    finally:
        no_stall.close()
