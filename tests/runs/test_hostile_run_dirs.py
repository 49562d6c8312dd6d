"""explain, trace, progress and the report on hostile run directories: never raise or hang, say what they skipped.

Issue 18, items 4b and 13: a reviewer's 7,134 hostile run directories made ``explain`` and
``trace`` raise on 17.5% of them (TypeError, OverflowError, UnicodeDecodeError,
RecursionError, IsADirectoryError), and a FIFO named ``*.jsonl`` made them block forever.
Here a run directory as a job leaves it (event logs, key records written by the real
:class:`KeyLog`, our metrics files and the Gaudi bridge's) is damaged deterministically,
case by case (``random.Random(seed)``): fields of the wrong type, huge numbers, NaN and
infinities, deep nesting, invalid UTF-8, missing fields, torn lines, and directories,
FIFOs and devices named like logs. Every damaged line must be skipped and counted,
exactly once, and a rank whose metrics file is damaged reported as unreadable.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from recipecache.runs.events import Skipped
from recipecache.runs.explain import explain, format_explanation
from recipecache.keylog import KeyLog
from recipecache.runs.timeline import write_trace
from launcher import hpu_metrics
from launcher.progress import Progress
from recipecache.runs.report import build_report, format_report, load_graphs, load_metrics

CASES = 300
K0, K1 = "torch1:pt2:fx-graph-v1::fthreads1xx:c1", "torch1:pt2:fx-graph-v1::fthreads2xx:c1"

#: JSON texts that no field the readers use accepts
HOSTILE = [
    '[1, "two", null]', '{"x": {"y": [1]}}', "true", "NaN", "Infinity", "-Infinity", "1e999", "-5.0",
    "1" + "0" * 5000,  # more digits than Python turns into an int
    "[" * 50_000 + "]" * 50_000,  # deeper than the parser recurses
    "[" * 500 + "]" * 500,
    '"\xff\xfe"',  # written as latin-1 below: not UTF-8
]
#: whole lines that are no record
BAD_LINES = ["", "null", "[1, 2]", '{"event": "hit"}', "\xff\xfe not utf-8", '{"time": 1, "rank": 0, "ev']
EVENT_FIELDS = ("time", "rank", "event", "key", "duration", "reason", "bytes", "step")
KEY_FIELDS = (*EVENT_FIELDS, "components", "context", "graph", "env", "name", "shapes")
HPU_FIELDS = ((0, "statistics", "TotalNumber"), (0, "statistics", "TotalTime"), (1, "statistics", "TotalHit"),
              (1, "statistics"), (1, "metric_name"), (0,))
METRIC_FIELDS = (("graph_compilation", "TotalNumber"), ("graph_compilation", "TotalTime"), ("cache", "TotalHit"),
                 ("waits",), ("wait_s",), ("saved_s",), ("fallbacks",), ("fallbacks", "backend_down"), ("host",),
                 ("pid",), ("wall_s",))


def details(threads: int) -> list[str]:
    return ["[aaaa] gm: def forward(self, x): return x * 2", "[bbbb] example_inputs[0]: f32[8, 4]",
            f"[c{threads}] cpp_runtime_thread_count: {threads}", "[dddd] torch_version: 2.13"]


def write_run(run: Path) -> None:
    """Two ranks that compiled one graph under two keys (another thread count), as a job leaves them."""
    now = time.time()
    for rank, key in ((0, K0), (1, K1)):
        log = KeyLog(run / "events" / "keys", rank=rank)
        log.record(key, details(rank + 1), name="M.forward", shapes="f32[8,4]", context={"host": f"h{rank}"})
        log.close()
        records = [
            {"time": now + 1, "rank": rank, "key": key, "event": "miss", "duration": 0.01, "reason": "not_found"},
            {"time": now + 1.1, "rank": rank, "key": key, "event": "compile_start", "duration": 0.0},
            {"time": now + 9, "rank": rank, "key": key, "event": "compile", "duration": 7.5},
            {"time": now + 9.1, "rank": rank, "key": key, "event": "put", "duration": 0.1, "bytes": 10},
            {"time": now + 10, "rank": rank, "key": "", "event": "step", "duration": 0.0, "step": 0},
        ]
        (run / "events" / f"events-rank{rank}-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        metrics = {"rank": rank, "host": "h", "pid": 1, "wall_s": 12.0,
                   "graph_compilation": {"TotalNumber": 1, "TotalTime": 7.5, "AvgTime": 7.5},
                   "cache": {"TotalHit": 0, "TotalMiss": 1}, "waits": 0, "wait_s": 0.0, "saved_s": 0.0,
                   "refused": 0, "fallbacks": {"backend_down": 0}, "store": {"puts": 1}}
        (run / f"metrics-rank{rank}.json").write_text(json.dumps(metrics))
        gaudi = [{"metric_name": "graph_compilation", "triggered_by": "process_exit",
                  "statistics": {"TotalNumber": 2, "TotalTime": 10, "AvgTime": 5}},
                 {"metric_name": "recipe_cache", "triggered_by": "process_exit",
                  "statistics": {"TotalHit": 1, "TotalMiss": 2}}]
        (run / f"hpu-metrics-rank{rank}.json").write_text(json.dumps(gaudi))


@dataclass
class Damage:
    events: int = 0
    keys: int = 0
    #: special files in the event directory and in its keys/ directory
    event_files: int = 0
    key_files: int = 0
    #: ranks whose metrics file is damaged
    metrics: set[int] = field(default_factory=set)


def _hostile_line(rng: random.Random, line: str, fields: tuple[str, ...], required: tuple[str, ...]) -> str:
    rec: dict[str, Any] = json.loads(line)
    kind = rng.choice(("field", "field", "missing", "line"))
    if kind == "line":
        return rng.choice([*BAD_LINES, line[: len(line) // 2]])
    if kind == "missing":
        del rec[rng.choice(required)]
        return json.dumps(rec)
    rec[rng.choice([f for f in fields if f in rec])] = "__HOSTILE__"
    return json.dumps(rec).replace('"__HOSTILE__"', rng.choice(HOSTILE))


def damage_lines(rng: random.Random, path: Path, fields: tuple[str, ...], required: tuple[str, ...]) -> int:
    """Damage some distinct lines of the log ``path``; how many."""
    lines = path.read_text().splitlines()
    chosen = rng.sample(range(len(lines)), rng.randint(0, min(3, len(lines))))
    for i in chosen:
        lines[i] = _hostile_line(rng, lines[i], fields, required)
    path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))
    return len(chosen)


def special_file(rng: random.Random, path: Path) -> None:
    """Something named like a log that is no regular file: a FIFO, a directory, a link to a device."""
    kind = rng.choice(("fifo", "dir", "device"))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


def damage_metrics(rng: random.Random, path: Path, fields: tuple[tuple[Any, ...], ...]) -> None:
    """Damage a metrics file (ours or the Gaudi bridge's): one field at ``fields``, or the whole file."""
    if rng.random() < 0.3:
        path.unlink()
        if rng.random() < 0.5:
            special_file(rng, path)
        else:
            path.write_bytes(rng.choice([b"\xff\xfe{}", b"[" * 50_000, b"[1, 2]", b"1" + b"0" * 5000]))
        return
    data = json.loads(path.read_text())
    where = rng.choice(fields)
    target = data
    for part in where[:-1]:
        target = target[part]
    target[where[-1]] = "__HOSTILE__"
    path.write_bytes(json.dumps(data).replace('"__HOSTILE__"', rng.choice(HOSTILE)).encode("latin-1"))


def hostile_run(run: Path, seed: int) -> Damage:
    rng = random.Random(seed)
    write_run(run)
    damage = Damage()
    for rank in (0, 1):
        damage.events += damage_lines(rng, run / "events" / f"events-rank{rank}-1.jsonl", EVENT_FIELDS,
                                      ("time", "rank", "event"))
        damage.keys += damage_lines(rng, next((run / "events" / "keys").glob(f"keys-rank{rank}-*.jsonl")),
                                    KEY_FIELDS, ("time", "rank", "event", "key"))
        if rng.random() < 0.3:
            damage_metrics(rng, run / f"metrics-rank{rank}.json", METRIC_FIELDS)
            damage.metrics.add(rank)
        if rng.random() < 0.3:
            damage_metrics(rng, run / f"hpu-metrics-rank{rank}.json", HPU_FIELDS)
    for path, count in ((run / "events" / "events-rank9-1.jsonl", "event_files"),
                        (run / "events" / "keys" / "keys-rank9-1.jsonl", "key_files")):
        if rng.random() < 0.3:
            special_file(rng, path)
            setattr(damage, count, 1)
    return damage


@pytest.mark.timeout(300)
def test_hostile_run_directories_never_break_explain_trace_or_the_report(tmp_path: Path) -> None:
    for seed in range(CASES):
        run = tmp_path / f"case{seed}"
        damage = hostile_run(run, seed)
        why = f"seed {seed}: {damage}"

        skipped = Skipped()
        found = explain([run], skipped=skipped)
        format_explanation(found)
        json.dumps([g.to_dict() for g in found.groups], allow_nan=False)
        assert (skipped.records, len(skipped.files)) == (damage.keys, damage.key_files), why

        skipped = Skipped()
        trace = write_trace(run, run / "trace.json", skipped=skipped)
        json.dumps(trace, allow_nan=False)
        assert (skipped.records, len(skipped.files)) == (damage.events + damage.keys,
                                                         damage.event_files + damage.key_files), why

        Progress(run / "events", since=0.0, out=io.StringIO()).poll()  # the launcher's, while the job runs

        report = build_report(load_metrics(run), range(2), graphs=load_graphs(run / "events"),
                              hpu=hpu_metrics.load(run / hpu_metrics.DEFAULT_NAME), exit_code=0)
        format_report(report)
        json.dumps(report, allow_nan=False)
        assert report["skipped"]["records"] == damage.events + damage.keys, why
        assert {r["rank"] for r in report["ranks"] if r["status"] != "ok"} == damage.metrics, why


def recipecache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_cli_skips_a_fifo_and_damaged_lines_and_says_so_in_one_line(tmp_path: Path) -> None:
    """A FIFO named *.jsonl blocked trace (and explain) forever; damaged lines made them raise."""
    run = tmp_path / "run"
    write_run(run)
    os.mkfifo(run / "events" / "stuck.jsonl")
    os.mkfifo(run / "events" / "keys" / "stuck.jsonl")
    with open(run / "events" / "events-rank0-1.jsonl", "ab") as f:
        f.write(b'{"time": 1e999, "rank": 0, "key": "k", "event": "hit"}\n\xff\xfe\n')
    proc = recipecache("trace", str(run), "-o", str(tmp_path / "trace.json"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("\n") == 1 and "skipped 2 damaged record(s)" in proc.stderr, proc.stderr
    assert "2 file(s) that are not regular files" in proc.stderr and "Traceback" not in proc.stderr
    proc = recipecache("explain", str(run))
    assert proc.returncode == 0 and "cpp_runtime_thread_count" in proc.stdout, proc.stderr
    assert "1 file(s) that are not regular files" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_trace_never_replaces_an_output_that_is_not_a_regular_file(kind: str, tmp_path: Path) -> None:
    """Issue 34 (as for export): ``trace -o`` replaced a symlink or FIFO with a regular file, and a directory
    gave a traceback; ``--png`` wrote through the symlink. One line and exit 2, the thing left as it was."""
    run = tmp_path / "run"
    write_run(run)
    out = tmp_path / "out"
    if kind == "symlink":
        (tmp_path / "mine").write_bytes(b"mine")
        out.symlink_to(tmp_path / "mine")
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    mode = os.lstat(out).st_mode
    for args in (["-o", str(out)], ["-o", str(tmp_path / "trace.json"), "--png", str(out)]):
        proc = recipecache("trace", str(run), *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "not a regular file" in proc.stderr, proc.stderr
        assert os.lstat(out).st_mode == mode and (kind != "symlink" or (tmp_path / "mine").read_bytes() == b"mine")


def test_explain_of_a_job_whose_ranks_recorded_no_key_says_so(tmp_path: Path) -> None:
    """Ranks that never asked the store (torch's local cache served them) leave events but no key records."""
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "events" / "events-rank0-1.jsonl").write_text(
        json.dumps({"time": time.time(), "rank": 0, "key": "", "event": "step", "duration": 0.0, "step": 0}) + "\n")
    proc = recipecache("explain", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "holds no key records: its ranks asked the store for no graph" in proc.stdout
    assert recipecache("explain", str(tmp_path / "nothing")).returncode == 2, "no run directory stays bad input"
