"""recipecache.enable() with real torch.compile on CPU.

Every compile scenario is a fresh process (tests/workers/torch_worker.py) with its own
empty TORCHINDUCTOR_CACHE_DIR and TMPDIR, so nothing is shared through torch's local
caches. A ``g++`` wrapper first on PATH logs every compiler run: "compiled nothing"
means no C++ source was compiled, not just a counter at zero.

Cold compiles are what cost time here, so the three independent cold processes (with
recipecache, torch alone, and with the store down) run side by side in one
module-scoped fixture, and the hit and forgery processes, which read the cold run's
store, run side by side in another. The tests at the bottom exercise the artifact checks, the PGO merge and the FX
backend's get/put split in this process, without compiling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

import recipecache
from recipecache.envelope import read_header
from recipecache.events import read_events
from recipecache.torch_integration import pgo
from recipecache.torch_integration.artifact import (
    Artifact,
    ArtifactError,
    KernelFile,
    install,
)
from recipecache.torch_integration.metrics import Metrics

pytestmark = pytest.mark.torch

WORKER = Path(__file__).parent / "workers" / "torch_worker.py"
NAMESPACE = "torchtest"
SECRET = "torch-test-secret"
DOWN_URL = "redis://127.0.0.1:1/0?timeout=0.5"


@dataclass
class Run:
    dir: Path
    report: dict[str, Any]
    #: C++ sources the g++ wrapper saw compiled
    cpp_compiles: int

    @property
    def metrics(self) -> dict[str, Any]:
        return self.report["metrics"]


@dataclass
class ColdRuns:
    store_dir: Path
    cold: Run
    plain: Run
    down: Run


@dataclass
class Followups:
    hit: Run
    forged: Run
    forged_store: Path
    #: the model's forward graph, whose artifact was forged, and the genuine one
    forward_key: str
    genuine: Artifact


def _compiler_wrapper(directory: Path) -> None:
    """A ``g++`` that logs its arguments to ``$GXX_LOG`` and runs the real one."""
    real = shutil.which("g++")
    assert real is not None, "inductor needs g++"
    directory.mkdir(parents=True)
    wrapper = directory / "g++"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "$GXX_LOG"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)


def _start(base: Path, name: str, mode: str, *args: str, url: str | None = None,
           env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
    run_dir = base / name
    for sub in ("cache", "tmp"):
        (run_dir / sub).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(
        PATH=f"{base / 'bin'}{os.pathsep}{env['PATH']}",
        GXX_LOG=str(run_dir / "gxx.log"),
        TORCHINDUCTOR_CACHE_DIR=str(run_dir / "cache"),
        TMPDIR=str(run_dir / "tmp"),
        OMP_NUM_THREADS="1",
    )
    if mode == "rc":
        assert url is not None
        env.update(
            RECIPECACHE_URL=url,
            RECIPECACHE_NAMESPACE=NAMESPACE,
            RECIPECACHE_SECRET=SECRET,
            RECIPECACHE_EVENT_LOG=str(run_dir / "events"),
            RECIPECACHE_METRICS_FILE=str(run_dir / "metrics-rank{rank}.json"),
        )
    env.update(env_extra or {})
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(run_dir / "out.json"), mode, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, run_dir


def _finish(started: tuple[subprocess.Popen[str], Path]) -> Run:
    proc, run_dir = started
    output, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, output[-4000:]
    log = run_dir / "gxx.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return Run(run_dir, json.loads((run_dir / "out.json").read_text()), sum(".cpp" in line for line in lines))


def _events(run: Run) -> list[dict[str, Any]]:
    return list(read_events(run.dir / "events"))


def _forge(store_dir: Path, forward_key: str) -> Artifact:
    """What someone with write access to the store but not the secret could do; returns the genuine artifact.

    The forward graph's artifact is replaced by one carrying a foreign kernel, signed
    with another key; one bit of every AOTAutograd entry is flipped.
    """
    url = f"file://{store_dir}"
    genuine_store = recipecache.open_store(url, namespace=NAMESPACE, secret=SECRET)
    genuine = Artifact.unpack(genuine_store.get(forward_key), "fx")
    evil = Artifact("fx", genuine.entry, (KernelFile("ev/evil.main.so", b"\x7fELF not a kernel"),))
    recipecache.open_store(url, namespace=NAMESPACE, secret="not-the-secret").put(forward_key, evil.pack())
    backend = genuine_store.backend
    for entry in list(backend.scan(NAMESPACE)):
        blob = bytearray(backend.get(entry.key))
        if ":autograd-" in read_header(bytes(blob))[0]["key"]:
            blob[-1] ^= 1
            backend.put(entry.key, bytes(blob))
    return genuine


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("torch")
    _compiler_wrapper(base / "bin")
    return base


@pytest.fixture(scope="module")
def runs(base: Path) -> ColdRuns:
    """The cold processes, side by side: recipecache on an empty store, torch alone, store down."""
    store_dir = base / "store"
    started = [
        _start(base, "cold", "rc", "--pgo-sizes", "5,7", url=f"file://{store_dir}"),
        _start(base, "plain", "plain"),
        _start(base, "down", "rc", "--check-disable", url=DOWN_URL),
    ]
    cold, plain, down = (_finish(s) for s in started)
    return ColdRuns(store_dir, cold, plain, down)


@pytest.fixture(scope="module")
def followups(runs: ColdRuns, base: Path) -> Followups:
    """The processes that read the cold run's store, side by side: a clean hit, and a forged copy."""
    forged_store = base / "forged-store"
    shutil.copytree(runs.store_dir, forged_store)
    forward_key = next(e["key"] for e in _events(runs.cold) if e["event"] == "put")  # the model's forward graph
    genuine = _forge(forged_store, forward_key)
    started = [
        # joins a one-rank gloo group, so its PGO key says rank 0 where the cold run's said none; size 9
        # for `scaled` is new: only the shared PGO decision makes it the dynamic graph already stored
        _start(base, "hit", "rc", "--pgo-sizes", "9", "--dist", str(base / "hit-pg"),
               url=f"file://{runs.store_dir}", env_extra={"RECIPECACHE_METRICS_FLUSH": "1"}),
        _start(base, "forged", "rc", url=f"file://{forged_store}"),
    ]
    hit, forged = (_finish(s) for s in started)
    return Followups(hit, forged, forged_store, forward_key, genuine)


# -- cold, hit, equality ------------------------------------------------------------
def test_cold_process_compiles_and_publishes_complete_artifacts(runs: ColdRuns) -> None:
    m = runs.cold.metrics
    # model forward + backward, then `scaled` static (size 5) and dynamic (size 7)
    assert m["graph_compilation"]["TotalNumber"] == 4
    assert m["cache"] == {"TotalHit": 0, "TotalMiss": 4}
    assert m["lookups"]["fx"]["put"] == 4, "one graph artifact per compiled graph"
    assert sum(m["lookups"][kind]["put"] for kind in ("aot", "pgo", "isa")) >= 4, "AOTAutograd entries, PGO state and the ISA probe"
    assert m["store"]["puts"] == sum(counts["put"] for counts in m["lookups"].values())
    assert m["kernels"]["shipped"] >= 4
    assert runs.cold.cpp_compiles >= 4, "the g++ wrapper must see the cold compiles for the hit test to mean anything"
    assert m["refused"] == 0 and m["fallbacks"] == {}
    assert m["stall_s"] == pytest.approx(m["graph_compilation"]["TotalTime"] + m["wait_s"], abs=1e-5)

    assert runs.cold.report["metrics_file_before_exit"] is None, "without RECIPECACHE_METRICS_FLUSH: at exit only"
    written = json.loads((runs.cold.dir / "metrics-rank0.json").read_text())
    assert written["graph_compilation"]["TotalNumber"] == 4 and written["pid"] == m["pid"]

    events = _events(runs.cold)
    compiled = {e["key"]: e["duration"] for e in events if e["event"] == "compile"}
    published = {e["key"] for e in events if e["event"] == "put"}
    assert len(compiled) == 4 and all(d > 0 for d in compiled.values())
    assert set(compiled) == published
    # the trace holds graph keys only: the simulator replays every key in it as a compile
    assert {e["key"] for e in events if e["event"] != "step"} == published
    assert [e["step"] for e in events if e["event"] == "step"] == [0, 1]


def test_fresh_process_hits_everything_and_compiles_nothing(runs: ColdRuns, followups: Followups) -> None:
    hit = followups.hit
    m = hit.metrics
    assert m["graph_compilation"]["TotalNumber"] == 0
    assert hit.cpp_compiles == 0, "a hit must not run the compiler (kernels and ISA probes come from the store)"
    assert m["cache"] == {"TotalHit": 3, "TotalMiss": 0}
    assert m["lookups"]["pgo"]["hit"] == 1 and m["lookups"]["isa"]["hit"] == 1
    assert m["kernels"]["installed"] >= 4
    assert m["saved_s"] > 0 and m["stall_s"] == 0
    assert hit.report["digest"] == runs.cold.report["digest"] == runs.plain.report["digest"]
    assert hit.report["metrics_file_before_exit"]["cache"] == {"TotalHit": 3, "TotalMiss": 0}, "flushed on change"


def _header_builds(run: Run) -> int:
    """g++ runs for torch's precompiled header: the preprocess of header.hpp and the .gch build."""
    log = run.dir / "gxx.log"
    return sum("header.hpp" in line or ".gch" in line for line in log.read_text().splitlines()) if log.exists() else 0


def test_compiles_keep_precompiled_headers_and_a_hit_never_builds_one(runs: ColdRuns, followups: Followups) -> None:
    """Issue 14: torch's fast compile setting stays on (pinned, so keys match), and a hit needs no header."""
    assert _header_builds(runs.cold) >= 2, "a cold compile preprocesses and precompiles the header"
    assert _header_builds(runs.down) >= 2, "headers turned off before enable() are pinned back on"
    assert _header_builds(followups.hit) == 0
    assert not list((followups.hit.dir / "tmp").rglob("*.gch")), "nothing of the 150 MB header in a hit's TMPDIR"


def test_recipecache_gives_torch_alone_results(runs: ColdRuns) -> None:
    assert runs.cold.report["digest"] == runs.plain.report["digest"]
    assert runs.plain.cpp_compiles > 0 and "metrics" not in runs.plain.report


# -- failures -------------------------------------------------------------------------
def test_forged_and_tampered_artifacts_are_refused_and_compiled_locally(runs: ColdRuns, followups: Followups) -> None:
    """Issue 6: "a test forges one"."""
    run = followups.forged
    m = run.metrics
    assert m["refused"] == 2
    assert m["store"]["misses_by_reason"]["bad_signature"] == 1
    assert m["store"]["misses_by_reason"]["corrupt"] == 1
    assert m["graph_compilation"]["TotalNumber"] == 1, "only the forged graph is compiled again; the backward hits"
    assert run.cpp_compiles >= 1
    assert not list(run.dir.rglob("evil*"))
    assert run.report["digest"] == runs.cold.report["digest"]
    genuine_store = recipecache.open_store(f"file://{followups.forged_store}", namespace=NAMESPACE, secret=SECRET)
    republished = Artifact.unpack(genuine_store.get(followups.forward_key), "fx")
    assert [f.path for f in republished.files] == [f.path for f in followups.genuine.files]


def test_store_down_training_works_and_fallbacks_are_counted(runs: ColdRuns) -> None:
    m = runs.down.metrics
    assert m["fallbacks"]["backend_down"] >= 1
    assert m["graph_compilation"]["TotalNumber"] == 2 and m["cache"]["TotalHit"] == 0
    assert m["store"]["puts"] == 0
    assert runs.down.report["digest"] == runs.plain.report["digest"]


def test_disable_restores_every_setting_and_stops_using_the_store(runs: ColdRuns) -> None:
    report = runs.down.report
    before, enabled, disabled = report["settings_before"], report["settings_enabled"], report["settings_disabled"]
    assert disabled == before
    assert [name for name in before if enabled[name] == before[name]] == [], "every setting is changed by enable()"
    after = report["metrics_after_disabled_compile"]
    # the matmul compiled after disable() is a new graph: enabled, it would have been looked up
    assert after["lookups"] == runs.down.metrics["lookups"]
    assert after["graph_compilation"] == runs.down.metrics["graph_compilation"]


# -- in-process: no compiles -----------------------------------------------------------
def _raw_artifact(kind: str, files: list[dict[str, Any]]) -> bytes:
    """An artifact built without :class:`KernelFile`'s checks, as an attacker would."""
    return msgpack.packb({"format": "recipecache-torch/1", "kind": kind, "entry": b"{}", "compile_s": 1.0,
                          "files": files}, use_bin_type=True)


@pytest.mark.parametrize("path", ["../x.so", "/tmp/x.so", "ab/../../x.so", "ab/x.py", "abc/x.so", "ab/c/x.so"])
def test_artifact_refuses_paths_outside_the_kernel_layout(path: str, tmp_path: Path) -> None:
    blob = _raw_artifact("fx", [{"path": path, "sha256": hashlib.sha256(b"x").digest(), "data": b"x"}])
    with pytest.raises(ArtifactError):
        Artifact.unpack(blob, "fx")
    with pytest.raises(ArtifactError):
        KernelFile(path, b"x")


def test_artifact_round_trip_checksums_and_install(tmp_path: Path) -> None:
    art = Artifact("fx", b'{"data": ""}', (KernelFile("ab/cdef.main.so", b"lib"),), 2.5)
    assert Artifact.unpack(art.pack(), "fx") == art
    with pytest.raises(ArtifactError, match="kind"):
        Artifact.unpack(art.pack(), "aot")
    bad_sum = _raw_artifact("fx", [{"path": "ab/cdef.so", "sha256": b"\0" * 32, "data": b"lib"}])
    with pytest.raises(ArtifactError, match="checksum"):
        Artifact.unpack(bad_sum, "fx")
    for garbage in (b"", b"\x80\x04K\x01.", pickle.dumps({"format": "recipecache-torch/1"})):
        with pytest.raises(ArtifactError):
            Artifact.unpack(garbage, "fx")
    assert install(art.files, tmp_path) == 1
    assert (tmp_path / "ab" / "cdef.main.so").read_bytes() == b"lib"
    assert install(art.files, tmp_path) == 0, "a kernel already present is kept"


def test_pgo_key_is_the_same_for_every_rank() -> None:
    keys = {pgo.shared_key(f"pt2:dynamo-pgo::job:with:colons:{rank}:tag:c1") for rank in ("0", "1", "None")}
    assert keys == {"pt2:dynamo-pgo::job:with:colons:*:tag:c1"}
    assert pgo.shared_key("pt2:fx-graph-v1::abc:c1") == "pt2:fx-graph-v1::abc:c1"


def test_pgo_merge_keeps_another_ranks_dynamic_decision() -> None:
    from torch._dynamo.pgo import CodeId, CodeState, FrameStateSizeEntry, auto_dynamic

    def encode(states: dict[CodeId, dict[str, tuple[Any, ...]]]) -> bytes:
        table: defaultdict[CodeId, CodeState] = defaultdict(CodeState)
        for code_id, sizes in states.items():
            for name, size in sizes.items():
                table[code_id].automatic_dynamic[name] = FrameStateSizeEntry(size=size)
        return json.dumps({"data": base64.b64encode(pickle.dumps(table)).decode()}).encode()

    f, g = CodeId("a.py", 1, "f", "h1"), CodeId("a.py", 9, "g", "h1")
    static_here = encode({f: {"x": (5, 3)}})
    dynamic_elsewhere = encode({f: {"x": (auto_dynamic, 3)}, g: {"y": (2,)}})
    merged = pickle.loads(base64.b64decode(json.loads(pgo.merge(static_here, dynamic_elsewhere))["data"]))
    assert merged[f].automatic_dynamic["x"].size == (auto_dynamic, 3)
    assert merged[g].automatic_dynamic["y"].size == (2,)


@pytest.fixture
def integration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The hooks' shared state on a memory store, without touching torch's settings."""
    from recipecache.torch_integration import _hooks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    store = recipecache.open_store("memory://", namespace=NAMESPACE)
    it = _hooks.Integration(store, Metrics(store, None, flush=False), wait_timeout=0.5)
    yield it
    it.end_attempt()


FX_KEY = "pt2:fx-graph-v1::fkey:c1"


def test_fx_miss_leads_and_the_put_publishes_through_the_flight(integration: Any) -> None:
    from recipecache.torch_integration._hooks import KEY_PREFIX

    assert integration.fx_get(FX_KEY) is None
    assert integration.attempt.flight.role == "leader"
    integration.compiled(2.5)  # what the codegen wrapper reports
    integration.fx_put(FX_KEY, b'{"data": ""}')
    assert integration.attempt.flight is None
    stored = Artifact.unpack(integration.store.get(KEY_PREFIX + FX_KEY), "fx")
    assert stored.compile_s == 2.5 and stored.entry == b'{"data": ""}'
    assert integration.fx_get(FX_KEY) == b'{"data": ""}'
    m = integration.metrics.snapshot()
    assert m["cache"] == {"TotalHit": 1, "TotalMiss": 1} and m["saved_s"] == 2.5
    assert m["graph_compilation"]["TotalNumber"] == 1 and m["store"]["compiles"] == 1


def test_a_compile_that_never_puts_frees_its_lease(integration: Any) -> None:
    from recipecache.torch_integration._hooks import KEY_PREFIX

    assert integration.fx_get(FX_KEY) is None
    integration.end_attempt()  # what the _compile_fx_inner wrapper does when the compile raised
    with integration.store.begin(KEY_PREFIX + FX_KEY, wait_timeout=0.5) as flight:
        assert flight.role == "leader", "the lease was released, so nobody waits for it"


def test_bad_artifact_in_the_store_falls_back_without_writing(integration: Any, tmp_path: Path) -> None:
    from recipecache.torch_integration._hooks import KEY_PREFIX

    evil = _raw_artifact("fx", [{"path": "../../evil.so", "sha256": hashlib.sha256(b"x").digest(), "data": b"x"}])
    integration.store.put(KEY_PREFIX + FX_KEY, evil)  # verified by the store: only our checks stand in the way
    assert integration.fx_get(FX_KEY) is None
    m = integration.metrics.snapshot()
    assert m["fallbacks"] == {"bad_artifact": 1} and m["cache"]["TotalMiss"] == 1
    assert not list(tmp_path.rglob("evil.so"))


def test_the_header_is_skipped_only_for_a_kernel_already_built(integration: Any, tmp_path: Path) -> None:
    source = tmp_path / "ab" / "kernel.main.cpp"
    integration.record_write("main.cpp", str(source))
    assert not integration.kernel_is_built(), "no library yet: torch compiles it, with the header"
    source.parent.mkdir()
    (tmp_path / "ab" / "kernel.main.so").write_bytes(b"lib")
    assert integration.kernel_is_built()
    integration.record_write("h", str(tmp_path / "header.h"))  # torch's header stub: still the same kernel
    assert integration.kernel_is_built()
    integration.record_write("py", str(tmp_path / "wrapper.py"))  # something else: no kernel being loaded
    assert not integration.kernel_is_built()


def _join_header_builds() -> None:
    for thread in threading.enumerate():
        if thread.name == "recipecache-header":
            thread.join()


def test_a_rank_that_waited_builds_the_skipped_header_once_in_the_background(integration: Any) -> None:
    from recipecache.torch_integration._hooks import KEY_PREFIX

    built: list[str] = []
    integration.warm_header(lambda: built.append("fresh"), ("cpp_prefix.h", "cmd"))
    _join_header_builds()
    assert built == [], "a process that never waited (a fresh rank that only hits) builds no header"

    with integration.store.begin(KEY_PREFIX + FX_KEY) as other_rank:  # another rank compiles the graph
        assert other_rank.role == "leader"
        assert integration.fx_get(FX_KEY) is None  # waited 0.5 s for it, then compiles itself
    integration.end_attempt()
    for _ in range(2):
        integration.warm_header(lambda: built.append("waited"), ("cpp_prefix.h", "cmd"))
    _join_header_builds()
    assert built == ["waited"]


def test_a_torch_without_the_hook_points_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config
    from torch._inductor import compile_fx

    from recipecache import torch_integration

    monkeypatch.delattr(compile_fx, "_compile_fx_inner")
    before = (inductor_config.fx_graph_remote_cache, inductor_config.cpp_cache_precompile_headers)
    torch_integration.enable("memory://", namespace=NAMESPACE)
    try:
        assert torch_integration.metrics()["fallbacks"] == {"torch_internals": 1}
        assert (inductor_config.fx_graph_remote_cache, inductor_config.cpp_cache_precompile_headers) == before
    finally:
        torch_integration.disable()
