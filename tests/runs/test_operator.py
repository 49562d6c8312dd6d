"""What an operator sees, without torch: key records, the duplicate-compile analysis, ``explain``,
the trace, the report's new columns and sections, Gaudi's metrics files, progress lines, and the
``meta`` that ``ls`` shows. Real torchrun jobs for the same features are in test_operator_jobs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import recipecache
from recipecache import envelope
from recipecache.errors import ConfigError
from recipecache.eventlog import EventLog
from recipecache.runs.explain import analyse, explain, format_groups
from recipecache.keylog import KeyLog, graph_identity, parse_details
from recipecache.runs.keyinfo import differing, load_keys, short_key
from recipecache.runs.timeline import build_trace
from launcher import hpu_metrics
from launcher.main import build_parser
from launcher.launch_config import LaunchConfig
from launcher.progress import Progress
from recipecache.runs.report import build_report, format_report, load_metrics

GM = "<lambda>()\n\n\n\ndef forward(self, arg0_1):\n    mul = torch.ops.aten.mul.Tensor(arg0_1, 2)\n    return (mul,)\n"


def details(*, threads: int = 1, shape: str = "[8, 4]", device: str = "device(type='cpu')",
            tag: str = "", addr: str = "0x7f00") -> list[str]:
    """Hash-detail lines in torch's format ("[hash] name: value"); hashes follow the values like torch's do."""

    def h(value: str) -> str:
        import hashlib

        return hashlib.sha256(value.encode()).hexdigest()[:20]

    example = f"TensorMetadata(dtype=torch.float32, shape=torch.Size({shape}), device={device})"
    return [
        f"[{h(GM)}] gm: {GM}",
        f"[{h(example)}] example_inputs[0]: {example}",
        f"[{h('False')}] fx_kwargs[is_backward]: False",
        f"[{h('fn')}] fx_kwargs[get_decomp_fn]: <function select_decomp_table at {addr}>",  # same hash, other address
        f"[{h(tag)}] cache_key_tag: {tag}",
        f"[{h(str(threads))}] cpp_runtime_thread_count: {threads}",
        f"[{h('2.13')}] torch_version: \x8f\x01binary",
        f"[{h('cpp')}] inductor_config[cpu_backend]: cpp",
    ]


def test_parse_details_keeps_multiline_values_and_skips_other_lines() -> None:
    parsed = parse_details([*details(), "not a detail line"])
    assert parsed["gm"][1] == GM
    assert parsed["cpp_runtime_thread_count"][1] == "1"
    assert "not a detail line" not in " ".join(parsed)


def test_graph_identity_ignores_environment_device_index_and_addresses() -> None:
    base = graph_identity(parse_details(details()))
    assert graph_identity(parse_details(details(threads=2, tag="x", addr="0x7f99"))) == base
    cuda0 = graph_identity(parse_details(details(device="device(type='cuda', index=0)")))
    assert graph_identity(parse_details(details(device="device(type='cuda', index=1)"))) == cuda0
    assert graph_identity(parse_details(details(shape="[16, 4]"))) != base, "another shape is another graph"


def test_key_log_records_environment_once_and_loads_joined(tmp_path: Path) -> None:
    log = KeyLog(tmp_path / "events" / "keys", rank=1)
    log.record("torch1:pt2:fx-graph-v1::fabc:c1", details(), name="M.forward", shapes="f32[8,4]",
               context={"host": "h1"})
    log.record("torch1:pt2:fx-graph-v1::fdef:c1", details(shape="[16, 4]"), name="M.forward", shapes="f32[16,4]")
    log.close()
    lines = [json.loads(line) for line in next((tmp_path / "events" / "keys").glob("*.jsonl")).read_text().splitlines()]
    assert [line["event"] for line in lines] == ["key_env", "key", "key"], "one environment, two keys"
    assert len(json.dumps(lines[1])) < 4000, "a key record carries the graph components only"
    keys = load_keys(tmp_path)
    info = keys["torch1:pt2:fx-graph-v1::fabc:c1"][0]
    assert (info.rank, info.label, info.context) == (1, "M.forward f32[8,4]", {"host": "h1"})
    assert info.components["cpp_runtime_thread_count"][1] == "1"  # the environment joined in
    assert info.components["torch_version"][1].startswith("<binary, hash")
    assert short_key(info.key) == "fabc"
    assert load_keys(tmp_path, since=time.time() + 60) == {}


def test_key_log_without_a_directory_writes_nothing(tmp_path: Path) -> None:
    log = KeyLog.beside(EventLog(None))
    assert not log.enabled
    assert log.record("k", details()) == graph_identity(parse_details(details()))


# -- duplicates, misses, explain ---------------------------------------------------------------
K0, K1 = "torch1:pt2:fx-graph-v1::fthreads1xx:c1", "torch1:pt2:fx-graph-v1::fthreads2xx:c1"
K_OTHER = "torch1:pt2:fx-graph-v1::fothershape:c1"


def write_job(run_dir: Path, events: list[tuple[float, int, str, str, dict[str, Any]]]) -> None:
    """Key records (ranks 0 and 2 on 1 thread, rank 1 on 2) and event logs, as a job would leave them."""
    for rank, threads in ((0, 1), (1, 2), (2, 1)):
        log = KeyLog(run_dir / "events" / "keys", rank=rank)
        log.record(K1 if threads == 2 else K0, details(threads=threads), name="M.forward", shapes="f32[8,4]",
                   context={"host": f"h{rank}"})
        log.record(K_OTHER, details(shape="[16, 4]"), name="M.forward", shapes="f32[16,4]")
        log.close()
    by_rank: dict[int, list[str]] = {}
    for t, rank, event, key, extra in events:
        by_rank.setdefault(rank, []).append(json.dumps({"time": t, "rank": rank, "key": key, "event": event,
                                                        "duration": extra.pop("duration", 0.0), **extra}))
    for rank, lines in by_rank.items():
        (run_dir / "events" / f"events-rank{rank}-1.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    now = time.time()
    write_job(tmp_path, [
        (now + 1, 0, "miss", K0, {"reason": "not_found"}),
        (now + 1.1, 0, "compile_start", K0, {}),
        (now + 10, 0, "compile", K0, {"duration": 8.9}),
        (now + 10.1, 0, "put", K0, {"duration": 0.1, "bytes": 10}),
        (now + 1, 1, "miss", K1, {"reason": "not_found"}),
        (now + 9, 1, "compile", K1, {"duration": 7.5}),  # another key: the thread count
        (now + 1, 2, "miss", K0, {"reason": "not_found"}),
        (now + 11, 2, "wait", K0, {"duration": 10.0}),  # a follower: its load is the end of its wait
        (now + 12, 2, "miss", K_OTHER, {"reason": "bad_signature"}),
        (now + 20, 2, "compile", K_OTHER, {"duration": 7.0}),
        (now + 1, 0, "hit", K_OTHER, {"duration": 0.02}),  # rank 0 loaded it before rank 2 compiled
        (now + 21, 0, "step", "", {"step": 0}),
        (now + 21, 2, "step", "", {"step": 0}),
    ])
    return tmp_path


def test_analysis_names_duplicates_and_misses_with_reasons(job: Path) -> None:
    from recipecache.runs.explain import analyse_run

    result = analyse_run(job).to_dict()
    assert len(result["duplicates"]) == 1
    dup = result["duplicates"][0]
    assert dup["label"] == "M.forward f32[8,4]"
    assert [(c["rank"], c["reason"]) for c in dup["compiles"]] == [
        (0, None), (1, "different key: cpp_runtime_thread_count")]
    missed = {(m["rank"], m["label"]): m["reason"] for m in result["missed"]}
    assert missed == {
        (1, "M.forward f32[8,4]"): "different key: cpp_runtime_thread_count",  # rank 2 loaded K0 meanwhile
        (2, "M.forward f32[16,4]"): "refused: bad_signature",
    }


@pytest.mark.parametrize(("events", "reason"), [
    ([("fallback", {"reason": "wait_timeout"})], "waited past the deadline (wait_timeout)"),
    ([("fallback", {"reason": "backend_down"})], "store down (backend_down)"),
    ([("miss", {"reason": "guard_rejected"})], "torch's guards rejected the stored entry (guard_rejected)"),
    ([("takeover", {})], "took over the lease of a rank that stopped renewing it"),
    ([], "unknown (the store was not asked, or the lease was lost)"),
])
def test_same_key_duplicate_reasons(events: list[tuple[str, dict[str, Any]]], reason: str) -> None:
    records = [{"time": 1.0, "rank": 0, "key": K0, "event": "compile", "duration": 1.0}]
    records += [{"time": 2.0, "rank": 1, "key": K0, "event": kind, "duration": 0.0, **extra} for kind, extra in events]
    records += [{"time": 5.0, "rank": 1, "key": K0, "event": "compile", "duration": 2.0}]
    dup = analyse(records, {}).duplicates[0]
    assert dup.compiles[1].reason == reason
    assert dup.label == f"graph {short_key(K0)}"  # no key records: named by hash


def test_single_flight_job_has_no_duplicates(job: Path) -> None:
    records = [{"time": 10.0, "rank": 0, "key": K0, "event": "compile", "duration": 9.0},
               {"time": 11.0, "rank": 1, "key": K0, "event": "hit", "duration": 0.01}]
    result = analyse(records, load_keys(job))
    assert (result.duplicates, result.missed) == ([], []), "the producer did not miss what others hit"


def test_explain_puts_the_differing_components_side_by_side(job: Path) -> None:
    groups = explain([job]).groups
    assert len(groups) == 1
    group = groups[0]
    assert [(short_key(k), ranks) for k, ranks in group.keys] == [("fthreads1x", (0, 2)), ("fthreads2x", (1,))]
    assert dict(group.differences) == {"cpp_runtime_thread_count": ("1", "2")}
    text = format_groups(groups)
    assert "cpp_runtime_thread_count  1" in text and "(host)" in text
    assert explain([job], key="fthreads2").groups == groups
    with pytest.raises(ConfigError, match="was not recorded"):
        explain([job], key="fnothere")


def test_differing_shows_absent_components() -> None:
    from recipecache.runs.keyinfo import KeyInfo

    a = KeyInfo("a", 0, "g", "f", "", {"x": ["1", "1"], "y": ["2", "2"]})
    b = KeyInfo("b", 1, "g", "f", "", {"x": ["1", "1"]})
    assert differing([a, b]) == [("y", ["2", "(absent)"])]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_explain_and_trace_cli(job: Path, tmp_path: Path) -> None:
    proc = run_cli("explain", str(job))
    assert proc.returncode == 0, proc.stderr
    assert "cpp_runtime_thread_count" in proc.stdout
    data = json.loads(run_cli("explain", str(job), "--json").stdout)
    assert data[0]["differences"] == [{"component": "cpp_runtime_thread_count", "values": ["1", "2"]}]
    out = tmp_path / "t.json"
    proc = run_cli("trace", str(job), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["traceEvents"]
    missing = run_cli("explain", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1


def test_trace_has_a_track_per_rank_and_named_spans(job: Path) -> None:
    from recipecache.runs.timeline import load_run

    trace = json.loads(json.dumps(build_trace(*load_run(job))))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (h0)", 1: "rank 1 (h1)", 2: "rank 2 (h2)"}
    compiles = [e for e in events if e["ph"] == "X" and e["cat"] == "compile"]
    assert {(e["pid"], e["name"]) for e in compiles} == {
        (0, "compile M.forward f32[8,4]"), (1, "compile M.forward f32[8,4]"), (2, "compile M.forward f32[16,4]")}
    assert min(e["ts"] for e in events if "ts" in e) == 0.0
    assert next(e for e in compiles if e["pid"] == 0)["dur"] == pytest.approx(8.9e6)
    assert any(e["ph"] == "X" and e["cat"] == "wait" for e in events)
    assert any(e["ph"] == "i" and e["pid"] == 2 and e["name"] == "hit M.forward f32[8,4]" for e in events), \
        "a follower's load is a hit"
    instants = {(e["pid"], e["name"]) for e in events if e["ph"] == "i"}
    assert (2, "step 0") in instants and (2, "miss M.forward f32[16,4] (bad_signature)") in instants


def test_png_is_drawn(job: Path, tmp_path: Path) -> None:
    from recipecache.runs.timeline import draw

    draw(job, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def no_stall_job(run_dir: Path) -> Path:
    """A --no-stall job: rank 0 compiles K0 in its worker while both ranks run it without inductor, then switch."""
    now = time.time()
    eager = [(now + t, rank, "eager", K0, {"duration": 0.2}) for rank in (0, 2) for t in (2, 3, 4)]
    write_job(run_dir, [
        (now + 1, 0, "miss", K0, {"reason": "not_found"}),
        (now + 1.1, 0, "compile_start", K0, {"behind": True}),
        (now + 4.5, 0, "compile", K0, {"duration": 3.0, "behind": True}),
        *eager,
        (now + 5, 0, "switch", K0, {"duration": 0.1}),
        (now + 5.2, 2, "switch", K0, {"duration": 0.1}),
    ])
    return run_dir


def test_no_stall_trace_has_a_worker_thread_and_one_eager_span_per_rank_and_graph(tmp_path: Path) -> None:
    from recipecache.runs.timeline import BEHIND_TID, EAGER_TID, draw, eager_spans, load_run

    records, keys = load_run(no_stall_job(tmp_path))
    events = build_trace(records, keys)["traceEvents"]
    spans = [(e["pid"], e["tid"], e["name"]) for e in events if e["ph"] == "X"]
    assert (0, BEHIND_TID, "compile behind M.forward f32[8,4]") in spans
    assert not [s for s in spans if s[1] == 0 and s[2].startswith("compile")], "the worker's compile is not the rank's"
    eager = {e["pid"]: e for e in events if e["ph"] == "X" and e["tid"] == EAGER_TID}
    assert set(eager) == {0, 2}
    assert eager[2]["name"] == "without inductor M.forward f32[8,4] (3 calls)"
    assert eager[2]["dur"] == pytest.approx(2.2e6)  # from the first call's start (t 1.8) to the last's end (t 4)
    assert eager[2]["args"]["seconds"] == pytest.approx(0.6)
    assert [(s.rank, s.calls) for s in eager_spans(records)] == [(0, 3), (2, 3)]
    draw(tmp_path, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the report ------------------------------------------------------------------------------
def metrics_file(run_dir: Path, rank: int, **fields: Any) -> None:
    data = {"rank": rank, "host": "h", "pid": 1, "wall_s": 1.0,
            "graph_compilation": {"TotalNumber": 0, "TotalTime": 0.0, "AvgTime": 0.0},
            "cache": {"TotalHit": 0, "TotalMiss": 0}, "local_hits": {"fx": 4, "aot": 2}, **fields}
    (run_dir / f"metrics-rank{rank}.json").write_text(json.dumps(data))


def test_report_shows_local_hits_gaudi_figures_and_duplicates(job: Path) -> None:
    from recipecache.runs.explain import analyse_run

    metrics_file(job, 0)
    metrics_file(job, 1, local_hits={})  # a torch without the counters
    hpu = {0: {"compiles": 3, "compile_time": 120.0, "recipe_hits": 5, "recipe_misses": 3}}
    report = build_report(load_metrics(job), range(2), hpu=hpu, graphs=analyse_run(job).to_dict())
    assert [r["local_hits"] for r in report["ranks"]] == [4, 0] and report["total"]["local_hits"] == 4
    assert report["ranks"][0]["hpu"] == hpu[0] and "hpu" not in report["ranks"][1]
    assert report["total"]["hpu"] == hpu[0]
    assert report["duplicates"][0]["compiles"][1]["reason"] == "different key: cpp_runtime_thread_count"
    text = format_report(json.loads(json.dumps(report)))
    head, row0 = text.splitlines()[:2]
    assert head.split()[:4] == ["rank", "compiles", "hits", "local"] and "hpu_compiles" in head
    assert row0.split()[:4] == ["0", "0", "0", "4"] and " 3 " in row0
    assert "rank 0 first (8.9 s); rank 1 again: different key: cpp_runtime_thread_count" in text
    assert "rank 2: M.forward f32[16,4]: refused: bad_signature" in text
    plain = format_report(build_report(load_metrics(job), range(2)))
    assert "hpu_compiles" not in plain and "compiled by more than one rank" not in plain


# -- Gaudi's metrics files ----------------------------------------------------------------------
def bridge_file(path: Path, compiles: int, *, closed: bool = True) -> None:
    """A metrics file as the bridge's MetricJsonWriter writes it (process_exit trigger)."""
    entries = [
        {"metric_name": "graph_compilation", "triggered_by": "process_exit", "generated_on": "2026-01-01T00:00:00",
         "statistics": {"TotalNumber": compiles, "TotalTime": 5000 * compiles, "AvgTime": 5000}},
        {"metric_name": "cpu_fallback", "triggered_by": "process_exit", "generated_on": "2026-01-01T00:00:00",
         "statistics": {"TotalNumber": 0, "FallbackOps": {}}},
        {"metric_name": "recipe_cache", "triggered_by": "process_exit", "generated_on": "2026-01-01T00:00:00",
         "statistics": {"TotalHit": 7, "TotalMiss": compiles, "RecipeHit": {}, "RecipeMiss": {}}},
    ]
    text = "[" + ",\n".join(json.dumps(e) for e in entries) + ("]\n" if closed else "")
    path.write_text(text)


def test_gaudi_metrics_files_per_rank(tmp_path: Path) -> None:
    base = tmp_path / "hpu-metrics.json"
    bridge_file(tmp_path / "hpu-metrics-rank0.json", 2)
    bridge_file(tmp_path / "hpu-metrics-rank1.json", 9)
    bridge_file(tmp_path / "hpu-metrics-rank1.json.1", 4, closed=False)  # a rerun: the bridge never overwrites
    os.utime(tmp_path / "hpu-metrics-rank1.json", (time.time() - 100, time.time() - 100))
    (tmp_path / "hpu-metrics-rank2.json").write_text("Metric name: graph_compilation\n")  # text format
    figures = hpu_metrics.load(base)
    assert figures == {0: {"compiles": 2, "compile_time": 10000, "recipe_hits": 7, "recipe_misses": 2},
                       1: {"compiles": 4, "compile_time": 20000, "recipe_hits": 7, "recipe_misses": 4}}
    assert hpu_metrics.load(base, since=time.time() + 60) == {}


def test_hpu_launch_sets_the_bridge_metrics_unless_the_user_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    config = LaunchConfig.from_args(build_parser().parse_args(
        ["--hpu", "--hpu-dir", str(tmp_path / "recipes"), "--run-dir", str(tmp_path / "run"), str(script)]))
    environ = config.rank_env({})
    assert environ["PT_HPU_METRICS_FILE"] == str(tmp_path / "run" / "hpu-metrics.json")
    assert environ["PT_HPU_METRICS_DUMP_TRIGGERS"] == "process_exit"
    mine = {"PT_HPU_METRICS_FILE": "/m/x.json", "PT_HPU_METRICS_DUMP_TRIGGERS": "metric_change"}
    assert {k: config.rank_env(mine)[k] for k in mine} == mine
    assert config.hpu_metrics_file(mine) == Path("/m/x.json")
    plain = LaunchConfig.from_args(build_parser().parse_args([str(script)]))
    assert "PT_HPU_METRICS_FILE" not in plain.rank_env({}) and plain.hpu_metrics_file({}) is None


# -- progress lines ----------------------------------------------------------------------------
def test_progress_prints_compile_start_and_finish_as_they_come(job: Path) -> None:
    import io

    out = io.StringIO()
    progress = Progress(job / "events", since=0.0, out=out)
    progress.poll()
    lines = out.getvalue().splitlines()
    assert "recipecache-run: rank 0 compiling M.forward f32[8,4] (fthreads1x)" in lines
    assert "recipecache-run: rank 0 compiled M.forward f32[8,4] (fthreads1x) in 8.9 s" in lines
    assert len([line for line in lines if "compiled" in line]) == 3
    with open(next((job / "events").glob("events-rank1-*.jsonl")), "a") as f:
        f.write(json.dumps({"time": time.time(), "rank": 1, "key": K1, "event": "fallback", "duration": 0.0,
                            "reason": "backend_down"}) + "\n" + '{"time": 1, "torn')
    progress.poll()
    assert out.getvalue().splitlines()[len(lines):] == [
        "recipecache-run: rank 1 compiling M.forward f32[8,4] (fthreads2x) without the store (backend_down)"]
    quiet = io.StringIO()
    Progress(job / "events", since=time.time() + 60, out=quiet).poll()
    assert quiet.getvalue() == "", "events older than the job are not progress"


# -- what ls shows ---------------------------------------------------------------------------------
def test_envelope_meta_round_trips_signed_and_checked() -> None:
    meta = {"kind": "graph", "name": "M.forward", "shapes": "f32[8,4]", "compile_s": 1.5}
    blob = envelope.seal("k", b"data", namespace="ns", secret=b"s" * 16, meta=meta)
    header, payload = envelope.open_envelope(blob, key="k", namespace="ns", secret=b"s" * 16)
    assert (header.meta, bytes(payload)) == (meta, b"data")
    assert envelope.open_envelope(envelope.seal("k", b"d", namespace="ns"), key="k", namespace="ns")[0].meta == {}
    tampered = blob.replace(b"M.forward", b"X.forward")
    with pytest.raises(recipecache.errors.VerificationError) as err:
        envelope.open_envelope(tampered, key="k", namespace="ns", secret=b"s" * 16)
    assert err.value.reason == "bad_signature", "meta is signed with the rest of the header"
    for bad in ({"shapes": "x" * 2000}, {"nested": {"a": 1}}, {1: "x"}):
        with pytest.raises(ValueError):
            envelope.seal("k", b"d", namespace="ns", meta=bad)  # type: ignore[arg-type]
    import msgpack

    prefix, header_len = envelope._PREFIX.unpack_from(blob)
    fields = msgpack.unpackb(blob[8:8 + header_len], raw=False)
    fields["meta"] = {"nested": [1]}
    forged = blob[:4] + envelope._PREFIX.pack(prefix, len(packed := msgpack.packb(fields)))[4:] + packed + b"data"
    with pytest.raises(recipecache.errors.VerificationError, match="meta"):
        envelope.open_envelope(forged, key="k", namespace="ns")


def test_ls_says_what_each_entry_is(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'c'}"
    store = recipecache.open_store(url, namespace="job")
    store.put("torch1:pt2:fx-graph-v1::fabc:c1", b"g", meta={"kind": "graph", "name": "TinyLM.forward",
                                                             "shapes": "i64[4,16]", "compile_s": 12.25})
    store.put("torch1:isa-probe:1", b"p", meta={"kind": "cpu_probe"})
    store.put("plain", b"x")
    proc = run_cli("ls", "--url", url, "--namespace", "job")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "TinyLM.forward i64[4,16]" in rows["graph"] and " 12.2 " in rows["graph"] and rows["graph"].endswith("ok")
    assert "torch1:isa-probe:1" in rows["cpu_probe"]
    assert "plain" in rows["-"]
    data = {r["key"]: r for r in json.loads(run_cli("ls", "--url", url, "--namespace", "job", "--json").stdout)}
    assert data["torch1:pt2:fx-graph-v1::fabc:c1"]["meta"]["compile_s"] == 12.25
    assert data["plain"]["meta"] == {} and data["plain"]["last_used"] > 0


def test_a_run_dir_written_before_no_stall_was_named_so_still_reports_its_graphs() -> None:
    """Metrics files and reports of an older release hold no-stall's rows under ``behind``: still shown."""
    from recipecache.runs.report import format_no_stall, no_stall_graphs

    row = {"name": "forward", "shapes": "f32[4]", "eager_calls": 3, "eager_s": 0.5, "compile_s": 2.0, "switched_at": 1.0}
    old, new = {0: {"behind": {"graphs": {"K": row}}}}, {0: {"no_stall": {"graphs": {"K": row}}}}
    assert no_stall_graphs(old) == no_stall_graphs(new) and no_stall_graphs(new)[0]["compiled_by"] == [0]
    graphs = no_stall_graphs(new)
    assert format_no_stall({"behind": graphs}) == format_no_stall({"no_stall": graphs}) != []


def test_the_report_says_in_plain_words_what_became_of_each_graph_compiled_behind() -> None:
    """Published by a rank, loaded from another process's compile, or not published (ended at exit past the grace,
    or failed): each says so, and the last two say that the next job compiles it (issue 43: a short job's compiles
    ended at exit were reported as "compiled behind by rank another job in 0.0 s")."""
    from recipecache.runs.report import format_no_stall, no_stall_graphs

    def row(**extra: Any) -> dict[str, Any]:
        return {"name": "forward", "shapes": "f32[4]", "eager_calls": 3, "eager_s": 0.5, "compile_s": 0.0,
                "switched_at": None, **extra}

    ended = "still compiling 96 s after the script ended (the exit grace); nothing published"
    cases = {
        "published": ({0: row(compile_s=2.0, switched_at=1.0)}, "compiled behind by rank 0 in 2.0 s and published"),
        "loaded": ({0: row(switched_at=1.0)}, "compiled by another process"),
        # the compile pool: rank 1 compiled rank 0's graph and never ran it (no "rank 1: never switched")
        "taken": ({0: row(switched_at=1.0), 1: row(eager_calls=0, compile_s=3.0)},
                  "compiled behind by rank 1 in 3.0 s and published; rank 0: 3 eager call(s), switched at"),
        "unfinished": ({0: row(unfinished=ended), 1: row()}, "NOT published: still compiling when the job ended"),
        "failed": ({0: row(failed="worker exited with status 1")}, "NOT published: the compile behind failed"),
    }
    for name, (ranks, words) in cases.items():
        graphs = no_stall_graphs({rank: {"no_stall": {"graphs": {"K": r}}} for rank, r in ranks.items()})
        text = "\n".join(format_no_stall({"no_stall": graphs}))
        assert words in text, (name, text)
        assert "another job in" not in text, (name, text)
        assert "never switched" not in text or name in ("unfinished", "failed"), (name, text)
    unfinished = no_stall_graphs({0: {"no_stall": {"graphs": {"K": row(unfinished=ended)}}}})
    assert unfinished[0]["ranks"]["0"]["unfinished"] == ended
    assert ended in "\n".join(format_no_stall({"no_stall": unfinished}))
