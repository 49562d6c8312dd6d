"""A user's first job: plain torchrun vs ``recipecache-run``, cold and warm, side by side.

The job (``cold_bench.py job``, run by torchrun in every rank) is a small GPT language
model (token + position embeddings, pre-LN blocks with causal attention and an MLP, a
tied-free head) trained with DDP over gloo on CPU, compiled with torch's defaults
(``torch.compile(model)``: automatic dynamic shapes). Every iteration trains one step
per sequence length and then runs an eval pass (no grad) over the lengths, so the job
meets training and inference graphs, static ones and the dynamic one torch recompiles
when a second length appears. Each rank runs in its own empty ``TORCHINDUCTOR_CACHE_DIR``
and ``TMPDIR``, as if on its own node.

Cases (``--cases``):

* ``rotated``: rank r meets the lengths rotated by r, so ranks meet shapes at different
  steps (what the shared store is for; target cold ratio <= 0.9);
* ``aligned``: every rank meets the same length at the same step (target <= 1.0).

Per case and repetition, interleaved (the order alternates so no side always runs
first; the short warm pair runs ``--warm-pairs`` times per repetition):

* ``plain cold``: ``torchrun`` with torch's defaults, empty dirs;
* ``rc cold``: ``recipecache-run --rank-dirs`` on an empty store;
* ``rc fresh``: ``recipecache-run --rank-dirs`` with empty dirs on the store ``rc cold`` filled;
* ``plain warm``: ``torchrun`` again in ``plain cold``'s dirs (torch's warm local caches);
* with ``--compare-tree DIR``, also ``base cold`` and ``base fresh``: ``rc cold`` and
  ``rc fresh`` run from another checkout (say the main branch), for a before/after;
* with ``--precompile``, also ``pc cold`` and ``pc fresh``: ``rc cold`` and ``rc fresh`` with
  ``recipecache-run --precompile`` (the precompiled tier, on a store of its own);
* with ``--no-stall``, also ``ns cold``: ``recipecache-run --no-stall`` on an empty store of its
  own (graphs run without inductor while one rank compiles each in a worker), and ``ns fresh``:
  fresh ranks with ``--no-stall`` on the store ``ns cold`` filled. Printed: each rank's slowest
  step of ``ns cold`` over plain cold's first step (the slowest rank's; targets <= 0.25, goal
  0.1), the job walls' ratio (target <= 1.1), the largest loss difference from plain cold at any
  step (target <= 2e-3: eager and compiled differ in the last bits), and the compiles and eager
  calls of ``ns fresh`` (target: none). Per rank also the seconds from its first graph sent to
  a worker to the end of its last compile there, beside those compiles' own seconds. With
  ``--compare-tree`` too, ``base ns cold`` runs the other checkout's no-stall cold beside it.
  Also the ``no_stall_failed`` fallbacks of ``ns cold`` (target 0).
* with ``--tf32``, every job first sets TF32 matmuls and convolutions and the float32 matmul
  precision ``high``, as training scripts do: settings torch's graph keys read, which a no-stall
  worker must compile under too.

Printed: the job walls, iteration 0 (the slowest rank's), each rank's critical path
(seconds inside steps, where compiles and waits happen; for recipecache also its compile
and wait seconds from the event log), medians, spreads (min-max) and the target ratios:
cold rc/plain wall, fresh-rank iter 0 / plain warm iter 0; with ``--precompile`` also the
tier's targets: ``pc cold`` wall / ``plain cold`` wall <= 1.0 (issue 21) and, for the whole job of
fresh ranks beside plain torchrun's warm job (issue 33): every iteration's time (the slowest
rank's) side by side, its compiles and fallbacks (0, each fallback with its cause), its wall
(<= 0.8x), iterations 0 + 1 (<= 0.2x, goal 0.1x) and every later iteration (<= 1.2x plain
warm's same iteration, the ratio's median over the pairs: each iteration's 20-40 ms jitter by some 10 ms
between jobs; with each median its 90% interval, and whether the pairs settle the target: every interval
within 1.2x, one wholly above, or not settled, which more ``--warm-pairs`` narrow: 5 pairs at least, 8 or more
on a shared machine), the share of the cores other processes took during each side's later iterations, beside
each later iteration's main-thread CPU ratio, where the later iterations' time went
(per part of the step, wall and CPU: :data:`ITER_PARTS`), the ranks' thread settings compared (a
difference makes the comparison unfair), and both jobs' timelines side by side (:func:`phases_table`: launcher start, torchrun's
agent, the ranks' process start, ``enable()``, the script's start, torch imported, each iteration's end, the
script's end, the rank processes gone, torchrun's exit, the report, the launcher's exit), so the wall's parts
outside the steps are seen. The runs of a case that start without PGO state must give bitwise-equal
losses, and so must the fresh runs that start from the store's (see ``SECOND_RUNS``), and
the tier's two runs (``PRECOMPILE_SCENARIOS``).

    python benchmarks/cold_bench.py [--reps 3] [--warm-pairs 2] [--cases rotated,aligned] [--quick]
                                    [--timeline] [--compare-tree /work/main] [--precompile] [--no-stall] [--tf32]
                                    [--json FILE]
    python benchmarks/cold_bench.py --precompile --fresh-only --workdir DIR [--warm-pairs 8] [--iters 8]
        (only the issue-33 pairs, on the plain cache and tier store a --precompile run left in DIR)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness.cpu import children_cpu_s

#: when the script began to run (in a rank: after the bootstrap and, under recipecache-run, enable())
SCRIPT_START = time.time()
ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("plain cold", "rc cold", "rc fresh", "plain warm")
#: with --compare-tree: recipecache-run from another checkout (e.g. before a change), cold and fresh
BASE_SCENARIOS = ("base cold", "base fresh")
#: with --no-stall: recipecache-run --no-stall, cold on its own store, then fresh ranks on it (and with
#: --compare-tree, the other checkout's no-stall cold on a store of its own)
NO_STALL_SCENARIOS = ("ns cold", "ns fresh", "base ns cold")
#: no-stall's targets: slowest step / plain cold first step, job wall / plain cold wall, loss difference
NO_STALL_STEP_TARGET, NO_STALL_STEP_GOAL, NO_STALL_WALL_TARGET, NO_STALL_LOSS_TARGET = 0.25, 0.1, 1.1, 2e-3
#: Losses are compared within each group. recipecache gives torch a job id, so torch's
#: automatic-dynamic decisions (PGO) are shared through the store: a fresh rank on a filled
#: store starts with the dimensions the cold job found dynamic and compiles dynamic graphs
#: where the cold job first compiled static ones, whose float rounding may differ in the last
#: bits. Plain torchrun has no job id, so torch keeps no PGO state and its warm run decides
#: as its cold run did. So: every run without PGO state must agree, and so must every run
#: that starts from the store's.
FIRST_RUNS = ("plain cold", "rc cold", "base cold", "plain warm")
SECOND_RUNS = ("rc fresh", "base fresh")
#: with --precompile: the precompiled tier, cold on an empty store and fresh ranks on it. A third loss
#: group: a rank may run the static artifact another rank built for a length where torch alone would run
#: its dynamic graph, so the tier's losses agree with each other bitwise (the fresh ranks load what the
#: cold job built and ran) and with the others within float rounding
PRECOMPILE_SCENARIOS = ("pc cold", "pc fresh")
PRECOMPILE_COLD_TARGET = 1.0
#: the job of fresh ranks on the tier's store against plain torchrun's warm job (issue 33): its iterations
#: 0 + 1 (goal 0.1), its wall, and each later iteration; no compile and no fallback at all
PRECOMPILE_FRESH_TARGET, PRECOMPILE_FRESH_GOAL = 0.2, 0.1
PRECOMPILE_FRESH_WALL_TARGET = 0.8
PRECOMPILE_FRESH_ITER_TARGET = 1.2
TARGETS = {"rotated": 0.9, "aligned": 1.0}
FRESH_TARGET = 1.0
VOCAB = 64


# -- the job (runs in every rank under torchrun) ------------------------------------------
def process_start(pid: int) -> float | None:
    """When process ``pid`` started (Unix time, from /proc; None elsewhere or when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


#: where a rank's iteration goes (summed over its steps): making the batches, the compiled forward of the
#: train steps, their backward (DDP's allreduce inside), the optimizer step with zero_grad, ``loss.item()``,
#: the eval calls, and the garbage collector's pauses (inside the others)
ITER_PARTS = ("batch", "forward", "backward", "optimizer", "item", "eval", "gc")


class PartClock:
    """Per iteration, the seconds (wall and this thread's CPU) each of :data:`ITER_PARTS` took, summed over its steps."""

    def __init__(self, iters: int) -> None:
        self.wall = {part: [0.0] * iters for part in ITER_PARTS}
        self.cpu = {part: [0.0] * iters for part in ITER_PARTS}
        self.iteration = 0
        self._last = (time.perf_counter(), time.thread_time())
        self._gc_start: tuple[float, float] | None = None

    def lap(self, part: str | None = None) -> float:
        """Count the time since the last lap to ``part`` (None: to nothing); returns now (``perf_counter``)."""
        now = (time.perf_counter(), time.thread_time())
        if part is not None:
            self.wall[part][self.iteration] += now[0] - self._last[0]
            self.cpu[part][self.iteration] += now[1] - self._last[1]
        self._last = now
        return now[0]

    def gc_pause(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` entry: the collector's pauses (inside the other parts too)."""
        if phase == "start":
            self._gc_start = (time.perf_counter(), time.thread_time())
        elif self._gc_start is not None:
            self.wall["gc"][self.iteration] += time.perf_counter() - self._gc_start[0]
            self.cpu["gc"][self.iteration] += time.thread_time() - self._gc_start[1]
            self._gc_start = None


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy (user, nice, system, irq, softirq, steal) since boot,
    from /proc/stat; 0.0 where there is none. A job's ranks subtract their own CPU from its change over their
    later iterations: what is left is what other processes took from the cores meanwhile."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    busy = [int(fields[i]) for i in (0, 1, 2, 5, 6, 7) if i < len(fields)]
    return sum(busy) / os.sysconf("SC_CLK_TCK")


def process_state(torch_threads: int) -> dict[str, Any]:
    """What a rank's steps compete with in its own process: torch's and OpenMP's threads, the process's
    threads by name, its CPU affinity and nice value (the same in both jobs, or the comparison is unfair)."""
    state: dict[str, Any] = {"torch_threads": torch_threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                             "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    if hasattr(os, "sched_getaffinity"):
        state["affinity"] = sorted(os.sched_getaffinity(0))
    names: dict[str, int] = {}
    cpu: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*") if Path("/proc/self/task").is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
        # each thread's CPU seconds (user + system), the main thread's under its own name
        label = "main" if task.name == str(os.getpid()) else f"{name}/{task.name}"
        cpu[label] = (int(fields[11]) + int(fields[12])) / tick
    state["threads"] = names
    state["thread_cpu_s"] = cpu
    state["python_threads"] = sorted(thread.name for thread in threading.enumerate())
    import torch._C._dynamo.eval_frame as eval_frame

    # dynamo's frame hook or a profiler left set after the calls would slow every frame of the steps
    state["eval_frame_callback"] = repr(getattr(eval_frame, "get_eval_frame_callback", lambda: "unknown")())
    state["profile_or_trace"] = repr((sys.getprofile(), sys.gettrace()))
    return state


def job(args: argparse.Namespace) -> None:
    """Train and evaluate the small GPT; rank 0 writes every rank's timings and losses to ``--out``.

    Each rank also writes its timeline marks (Unix times: its agent's and its own process start,
    the script's start, torch imported, the process group up, each iteration's end, the script's
    end) to ``--out.marks<rank>``, last, after the process group is gone.
    """
    marks = {"agent start": process_start(os.getppid()), "rank start": process_start(os.getpid()),
             "script start": SCRIPT_START}
    import torch
    import torch.distributed as dist
    from tiny_gpt import TinyGPT  # beside this script, on sys.path under torchrun and recipecache-run

    sys.path.insert(0, str(ROOT / "examples"))
    from train import gather_at_rank0
    from torch.nn.parallel import DistributedDataParallel

    def batch(it: int, step: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(it * 1009 + step * 31 + rank)
        start = torch.randint(0, VOCAB, (args.batch, 1), generator=gen)
        stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
        seq = (start + stride * torch.arange(length + 1)) % VOCAB
        return seq[:, :-1], seq[:, 1:]

    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    marks["torch imported"] = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marks["group up"] = time.time()
    lengths = [int(n) for n in args.lengths.split(",")]
    shift = rank if args.order == "rotated" else 0
    order = lengths[shift % len(lengths):] + lengths[:shift % len(lengths)]
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, max(lengths), args.dim, args.heads, args.layers, head_bias=True)
    ddp = DistributedDataParallel(model)
    compiled = torch.compile(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mine: dict[str, Any] = {"iter_s": [], "steps": [], "losses": [], "start": time.time(),
                            "iter_cpu_s": [], "iter_main_cpu_s": [], "iter_machine_busy_s": []}
    parts = PartClock(args.iters)
    gc.callbacks.append(parts.gc_pause)
    for it in range(args.iters):
        parts.iteration = it
        it_start, cpu_start, main_start = time.perf_counter(), time.process_time(), time.thread_time()
        busy_start = machine_busy_s()
        for step, length in enumerate(order):
            parts.lap()
            tokens, targets = batch(it, step, length)
            start = parts.lap("batch")
            loss = compiled(tokens, targets)
            parts.lap("forward")
            loss.backward()
            parts.lap("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = parts.lap("optimizer")
            mine["steps"].append(["train", it, length, time.time() - mine["start"], end - start])
            mine["losses"].append(loss.item())
            parts.lap("item")
        model.eval()
        with torch.no_grad():
            for step, length in enumerate(order):
                parts.lap()
                tokens, targets = batch(it, 100 + step, length)
                start = parts.lap("batch")
                loss = compiled(tokens, targets)
                end = parts.lap("eval")
                mine["steps"].append(["eval", it, length, time.time() - mine["start"], end - start])
                mine["losses"].append(loss.item())
                parts.lap("item")
        model.train()
        mine["iter_s"].append(time.perf_counter() - it_start)
        # CPU seconds of the iteration: the whole process (every thread) and the main thread alone
        mine["iter_cpu_s"].append(time.process_time() - cpu_start)
        mine["iter_main_cpu_s"].append(time.thread_time() - main_start)
        mine["iter_machine_busy_s"].append(machine_busy_s() - busy_start)
        marks[f"iter {it} end"] = time.time()
    gc.callbacks.remove(parts.gc_pause)
    mine["parts"], mine["parts_cpu"] = parts.wall, parts.cpu
    mine["process"] = process_state(torch.get_num_threads())
    ranks = gather_at_rank0(mine, Path(args.out), rank, world)  # not all_gather_object: see its docstring
    if ranks is not None:
        Path(args.out).write_text(json.dumps({"ranks": ranks, "threads": torch.get_num_threads()}))
    del compiled, ddp
    dist.destroy_process_group()
    marks["script end"] = time.time()
    Path(f"{args.out}.marks{rank}").write_text(json.dumps(marks))



# -- the driver ---------------------------------------------------------------------------
@dataclass
class Run:
    """One torchrun job: its wall time and what every rank reported."""

    scenario: str
    case: str
    rep: str
    wall_s: float
    ranks: list[dict[str, Any]]
    #: recipecache's event log (rc scenarios), for compile/wait seconds and the timeline
    events: list[dict[str, Any]] = field(default_factory=list)
    #: each rank's recipecache metrics file (rc scenarios)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    #: the job's phases: name -> Unix time (:func:`phase_marks`)
    phases: dict[str, float] = field(default_factory=dict)
    #: CPU seconds (user + system) of every process of the job that was waited for (ranks, workers, g++): on a
    #: machine whose cores the job keeps busy, the wall follows it
    cpu_s: float = 0.0

    @property
    def iter0_s(self) -> float:
        """Iteration 0 of the slowest rank: where the compiles are."""
        return max(r["iter_s"][0] for r in self.ranks)

    @property
    def first_two_s(self) -> float:
        """Iterations 0 and 1 of the slowest rank (issue 21's fresh-rank measure)."""
        return max(sum(r["iter_s"][:2]) for r in self.ranks)

    @property
    def iters_s(self) -> list[float]:
        """Each iteration's time, the slowest rank's (the ranks meet at every step's collective)."""
        return [max(times) for times in zip(*(r["iter_s"] for r in self.ranks))]

    @property
    def iters_main_cpu_s(self) -> list[float]:
        """Each iteration's CPU seconds of the rank's main thread, the largest rank's: the steps' own work,
        without the waits at the collectives and the time other processes held the cores."""
        return [max(times) for times in zip(*(r["iter_main_cpu_s"] for r in self.ranks))]

    def others_share(self, first: int) -> float | None:
        """The share of the machine's cores that processes other than the job's ranks took over iterations ``first``
        on: the machine's busy seconds meanwhile (as rank 0 saw them) less both ranks' CPU seconds, over the
        iterations' wall seconds times the cores. The same job is slower beside a busier machine, so a pair whose
        sides ran beside different loads says more about the machine than about the jobs. None without /proc/stat."""
        busy = sum(self.ranks[0].get("iter_machine_busy_s", [])[first:])
        if busy <= 0:
            return None
        own = sum(sum(r["iter_cpu_s"][first:]) for r in self.ranks)
        wall = sum(self.ranks[0]["iter_s"][first:]) * (os.cpu_count() or 1)
        return max(0.0, busy - own) / wall if wall > 0 else None

    def parts_s(self, clock: str, first: int) -> dict[str, float]:
        """Seconds of each :data:`ITER_PARTS` part from iteration ``first`` on (``clock`` ``parts``: wall,
        ``parts_cpu``: the main thread's CPU), the largest rank's."""
        return {part: max(sum(r[clock][part][first:]) for r in self.ranks) for part in ITER_PARTS}

    def process_states(self) -> list[dict[str, Any]]:
        """Each rank's threads, OpenMP setting, affinity and nice value (:func:`process_state`)."""
        return [r["process"] for r in self.ranks]

    @property
    def compiles(self) -> int:
        """Graphs inductor compiled in the job, all ranks (recipecache's metrics)."""
        return sum(m["graph_compilation"]["TotalNumber"] for m in self.metrics)

    def fallbacks(self) -> dict[str, int]:
        """Every fallback of the job by reason (the tier's ``precompile_fallback`` among them), summed over the ranks."""
        return self.summed("fallbacks")

    def fallback_details(self) -> list[str]:
        """Each rank's listed precompile fallbacks with their cause (``precompile_fallback_details``)."""
        return [f"rank {m['rank']} {d['detail']}: {d.get('error') or d['message']}"
                for m in self.metrics for d in m.get("precompile_fallback_details", [])]

    def precompile_fallbacks(self) -> dict[str, int]:
        """The precompiled tier's fallbacks by detail, summed over the ranks."""
        return self.summed("precompile_fallbacks")

    def summed(self, name: str) -> dict[str, int]:
        """A counter map of the ranks' metrics (``precompile_fallbacks``, ``precompile_shapes``), summed."""
        total: dict[str, int] = {}
        for m in self.metrics:
            for detail, n in m.get(name, {}).items():
                total[detail] = total.get(detail, 0) + n
        return total

    @property
    def critical_s(self) -> list[float]:
        """Per rank, seconds inside training and eval steps (compiles and waits happen there)."""
        return [sum(step[4] for step in r["steps"]) for r in self.ranks]

    def seconds(self, event: str) -> list[float]:
        """Per rank, the summed duration of ``event`` (compile, wait) in the event log."""
        out = [0.0] * len(self.ranks)
        for e in self.events:
            if e["event"] == event:
                out[e["rank"]] += e["duration"]
        return out

    def behind_span_s(self) -> list[float]:
        """Per rank, seconds from its first graph sent to a no-stall worker to the end of its last compile there.

        The compiles' own seconds plus what the worker cost around them (its start, imports, the
        queue): how long the rank's graphs waited to leave eager mode, in the job or at its exit.
        """
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for e in self.events:
            if e.get("behind") and e["event"] in ("compile_start", "compile"):
                rank = e["rank"]
                first[rank] = min(first.get(rank, e["time"]), e["time"])
                last[rank] = max(last.get(rank, e["time"]), e["time"])
        return [last[rank] - first[rank] if rank in first else 0.0 for rank in range(len(self.ranks))]

    @property
    def losses(self) -> list[list[float]]:
        return [r["losses"] for r in self.ranks]

    @property
    def first_step_s(self) -> float:
        """The slowest rank's first step: where plain torchrun compiles the first graph."""
        return max(r["steps"][0][4] for r in self.ranks)

    @property
    def worst_steps_s(self) -> list[float]:
        """Per rank, its slowest step."""
        return [max(step[4] for step in r["steps"]) for r in self.ranks]

    def count(self, event: str) -> int:
        return sum(1 for e in self.events if e["event"] == event)


class RankExits:
    """Watches /proc, from a thread, for the job's rank processes (their command line names ``marker``)
    and notes when the last one was gone: what a rank spends after its script (``atexit`` handlers,
    interpreter shutdown) is no mark the rank can write itself.

    It looks for the ``ranks`` ranks every 0.2 s until it found them, then checks only their pids, every 0.05 s:
    cheap beside the job on a busy machine. ``last`` is None where there is no /proc.
    """

    def __init__(self, marker: str, ranks: int = 2) -> None:
        import threading

        self.marker = marker.encode()
        self.ranks = ranks
        self.last: float | None = None
        self._gone: dict[int, float | None] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RankExits:
        if Path("/proc").is_dir():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._gone and all(t is not None for t in self._gone.values()):
            self.last = max(t for t in self._gone.values() if t is not None)

    def _watch(self) -> None:
        while not self._done.wait(0.05 if self._gone else 0.2):
            now = time.time()
            for pid, gone in self._gone.items():
                if gone is None and not Path(f"/proc/{pid}").exists():
                    self._gone[pid] = now
            for entry in Path("/proc").iterdir() if len(self._gone) < self.ranks else ():
                if entry.name.isdigit() and int(entry.name) not in self._gone:
                    try:
                        cmdline = (entry / "cmdline").read_bytes()
                    except OSError:
                        continue
                    rank = b"launcher.bootstrap" in cmdline and b"torch.distributed.run" not in cmdline
                    if rank and self.marker in cmdline:
                        self._gone[int(entry.name)] = None


def free_port() -> int:
    """A port for torchrun's rendezvous: others may run jobs on this machine at the same time."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_job(work: Path, scenario: str, case: str, rep: str, job_args: list[str], *, dirs: Path,
            store: Path | None, tree: Path = ROOT, launcher_args: Sequence[str] = (), nproc: int = 2,
            extra_env: Mapping[str, str] | None = None, script: Path | None = None) -> Run:
    """Start one job: plain torchrun (``store`` None) or recipecache-run on ``store``; every rank in ``dirs``/rankN.

    ``tree`` is the checkout whose launcher and recipecache run; ``script`` the job script (default this one), run
    as ``script job ARGS --out FILE`` in each of ``nproc`` ranks, with ``extra_env`` added to the environment
    (after torch's and recipecache's own variables are cleared). ``pool_bench.py`` runs its job through it.
    """
    from recipecache.runs.events import read_events

    name = f"{case}-{rep}-{scenario.replace(' ', '-')}"
    out = work / f"{name}.json"
    run_dir = work / f"{name}-run"
    port = ["--master-port", str(free_port())]
    script_args = [str((script or Path(__file__)).resolve()), "job", *job_args, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_", "OMP_"))}
    env["PYTHONPATH"] = str(tree)
    env.update(extra_env or {})
    if store is None:
        # torchrun as a user runs it; the launcher's bootstrap only points each rank at its own
        # TORCHINDUCTOR_CACHE_DIR and TMPDIR before torch is imported (recipecache stays off)
        env["RECIPECACHE_RANK_DIRS"] = str(dirs)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *port,
               "-m", "launcher.bootstrap", *script_args]
    else:
        cmd = [sys.executable, "-m", "launcher.main", "--nproc", str(nproc), *port, "--url", f"file://{store}",
               "--namespace", "cold-bench", "--run-dir", str(run_dir), "--rank-dirs", str(dirs), *launcher_args, *script_args]
    launched = time.time()
    start, cpu_start = time.perf_counter(), children_cpu_s()
    with RankExits(str(out), nproc) as exits:
        proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu_start
    ended = time.time()
    if proc.returncode != 0:
        log = work / f"{name}.log"  # whole: a rank's error can lie above thousands of lines of exit noise
        log.write_text(f"{' '.join(cmd)}\n-- stdout\n{proc.stdout}\n-- stderr\n{proc.stderr}")
        sys.exit(f"{name} failed ({proc.returncode}), whole output in {log}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    events = list(read_events(run_dir / "events")) if store is not None else []
    metrics = [json.loads(path.read_text()) for path in sorted(run_dir.glob("metrics-rank*.json"))]
    ranks_marks = [json.loads(path.read_text()) for path in sorted(out.parent.glob(f"{out.name}.marks*"))]
    report = run_dir / "report.json"
    run = Run(scenario, case, rep, wall, json.loads(out.read_text())["ranks"], events, metrics,
              phase_marks(launched, ended, ranks_marks, metrics, report if store is not None else None, exits.last),
              cpu)
    extra = ""
    if events:
        extra = (f"  compile {' '.join(f'{s:5.1f}' for s in run.seconds('compile'))}"
                 f"  wait {' '.join(f'{s:5.1f}' for s in run.seconds('wait'))}")
    if "--precompile" in launcher_args:
        extra += f"  compiles {run.compiles}  precompile fallbacks {run.precompile_fallbacks() or 'none'}"
    print(f"  {case:<8} rep {rep:<4} {scenario:<10}  wall {wall:6.1f} s  cpu {cpu:6.1f} s  iter0 {run.iter0_s:6.2f} s  "
          f"in steps {' '.join(f'{s:6.1f}' for s in run.critical_s)}{extra}", flush=True)
    return run


def phase_marks(launched: float, ended: float, ranks: list[dict[str, float | None]],
                metrics: list[dict[str, Any]], report: Path | None, ranks_gone: float | None) -> dict[str, float]:
    """The job's timeline (Unix times): launcher start, the ranks' marks (the latest rank's), enable()'s
    start and end (recipecache's metrics), the last rank process gone (:class:`RankExits`), torchrun's
    exit and the report written (recipecache-run's report), the launcher's exit. A mark that is missing
    (a launcher whose report has no ``started``, no /proc) is left out."""
    marks: dict[str, float] = {"launcher start": launched}
    job = json.loads(report.read_text()) if report is not None and report.is_file() else None
    if job is not None and "started" in job:
        marks["launcher ready"] = job["started"]
    for name in ranks[0] if ranks else ():
        values = [r[name] for r in ranks if r.get(name) is not None]
        if name == "script start":
            spans = [m["enable"] for m in metrics if m.get("enable")]
            if spans:
                marks["enable() start"] = max(span["start"] for span in spans)
                marks["enable() end"] = max(span["start"] + span["s"] for span in spans)
        if values:
            marks[name] = max(values)
    if ranks_gone is not None:
        marks["ranks exited"] = ranks_gone
    if job is not None and report is not None:
        if "started" in job:
            marks["torchrun exit"] = job["started"] + job["wall_s"]
        marks["report written"] = report.stat().st_mtime
    marks["launcher exit"] = ended
    return marks


def phases_table(runs: Sequence[Run]) -> str:
    """The runs' timelines side by side: seconds since the launcher started, and since the run's previous mark."""
    names: list[str] = []
    for run in runs:
        names += [name for name in run.phases if name not in names]
    # in the order of the last run that has the mark (the recipecache side, which has them all)
    order = sorted(names, key=lambda n: next(r.phases[n] - r.phases["launcher start"] for r in reversed(runs)
                                             if n in r.phases))
    lines = ["job timeline (the latest rank's marks): seconds since the launcher started (+ since the mark before)",
             f"  {'':<16}" + "".join(f"{run.scenario:>22}" for run in runs)]
    for name in order:
        cells = ""
        for run in runs:
            if name not in run.phases:
                cells += f"{'-':>22}"
                continue
            at = run.phases[name]
            prev = max((t for t in run.phases.values() if t < at), default=at)
            cells += f"{at - run.phases['launcher start']:>13.2f} (+{at - prev:5.2f})"
        lines.append(f"  {name:<16}{cells}")
    return "\n".join(lines)


def timeline(run: Run) -> str:
    """Per rank, the slow steps and the compile and wait events, in time order (seconds since the job's start)."""
    from recipecache.runs.keyinfo import short_key

    t0 = min(r["start"] for r in run.ranks)
    rows: list[tuple[float, float, int, str]] = []
    for e in run.events:
        if e["event"] in ("compile", "wait", "takeover", "fallback"):
            rows.append((e["time"] - e["duration"] - t0, e["time"] - t0, e["rank"], f"{e['event']:<8} {short_key(e['key'])}"))
    for rank, r in enumerate(run.ranks):
        for kind, it, length, end, seconds in r["steps"]:
            if seconds > 0.3:
                rows.append((r["start"] + end - seconds - t0, r["start"] + end - t0, rank, f"STEP {kind} it{it} L{length}"))
    lines = [f"timeline of {run.case} rep {run.rep} {run.scenario} (start, end, rank, what):"]
    lines += [f"  {a:7.1f} {b:7.1f}  r{rank}  {what}" for a, b, rank, what in sorted(rows)]
    return "\n".join(lines)


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Median (min-max) of ``values``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


#: how sure an interval of a median over the pairs must be before the verdict calls a later iteration
#: within or above its target
MEDIAN_COVERAGE = 0.9


def median_interval(values: Sequence[float], coverage: float = MEDIAN_COVERAGE) -> tuple[float, float] | None:
    """The narrowest interval between order statistics of ``values`` that holds their population's median with
    probability ``coverage`` or more (distribution-free: the binomial count of values below the median), or
    None when there are too few values for that (fewer than 5 at 0.9: even their min-max interval misses the
    median once in 2**(n-1) draws)."""
    ordered, n = sorted(values), len(values)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(exactly i values below the median)
    best = None
    for k in range(1, n // 2 + 1):  # the interval from the k-th smallest to the k-th largest
        if 1 - 2 * sum(below[:k]) >= coverage:
            best = (ordered[k - 1], ordered[n - k])
    return best


def interval_text(span: tuple[float, float] | None) -> str:
    """An interval of :func:`median_interval` as printed."""
    return f"{span[0]:.2f}-{span[1]:.2f}" if span is not None else "none (fewer than 5 pairs)"


#: one side's run of a repetition: a :class:`Run` here, pool_bench's ``Job`` around one
SideRun = TypeVar("SideRun")


def ratios(
    numerator: Sequence[SideRun], denominator: Sequence[SideRun], measure: Callable[[SideRun], float]
) -> list[float]:
    """Per repetition (runs of one repetition ran back to back), ``measure`` of one side over the other."""
    return [measure(a) / measure(b) for a, b in zip(numerator, denominator)]


def summarise(case: str, runs: list[Run]) -> dict[str, Any]:
    """Print the case's table and target ratios; returns the figures."""
    by = {scenario: [r for r in runs if r.scenario == scenario]
          for scenario in SCENARIOS + BASE_SCENARIOS + PRECOMPILE_SCENARIOS + NO_STALL_SCENARIOS}
    by = {scenario: rs for scenario, rs in by.items() if rs}
    mismatched = []
    for group in (FIRST_RUNS, SECOND_RUNS, PRECOMPILE_SCENARIOS):
        members = [r for r in runs if r.scenario in group]
        mismatched += [f"{r.scenario} rep {r.rep}" for r in members if r.losses != members[0].losses]
    print(f"\n== case {case}: {len(by['rc cold'])} repetition(s), medians (min-max)")
    print(f"{'scenario':<11} {'wall s':>20} {'iter 0 s':>20} {'in steps s, per rank':>30}  compile / wait s per rank")
    for scenario, rs in by.items():
        per_rank = [spread([r.critical_s[k] for r in rs], "{:.1f}") for k in range(len(rs[0].ranks))]
        cw = ""
        if rs[0].events:
            cw = " / ".join(" ".join(f"{statistics.median(r.seconds(ev)[k] for r in rs):.1f}" for k in range(len(rs[0].ranks)))
                            for ev in ("compile", "wait"))
        print(f"{scenario:<11} {spread([r.wall_s for r in rs], '{:.1f}'):>20} {spread([r.iter0_s for r in rs]):>20} "
              f"{'  '.join(per_rank):>30}  {cw}")
    slowest = lambda r: max(r.critical_s)  # noqa: E731
    figures: dict[str, Any] = {
        "cold_wall": ratios(by["rc cold"], by["plain cold"], lambda r: r.wall_s),
        "cold_iter0": ratios(by["rc cold"], by["plain cold"], lambda r: r.iter0_s),
        "cold_critical": ratios(by["rc cold"], by["plain cold"], slowest),
        "fresh_iter0": ratios(by["rc fresh"], by["plain warm"], lambda r: r.iter0_s),
    }
    target = TARGETS[case]
    met = lambda values, limit: "met" if statistics.median(values) <= limit else "MISSED"  # noqa: E731
    print(f"cold wall, recipecache-run / plain torchrun (per repetition): {spread(figures['cold_wall'])}  "
          f"target <= {target}: {met(figures['cold_wall'], target)}")
    print(f"cold iter 0 ratio {spread(figures['cold_iter0'])}; slowest rank's time in steps (critical path) "
          f"ratio {spread(figures['cold_critical'])}")
    print(f"fresh ranks on the filled store iter 0 / plain warm iter 0 (per pair): {spread(figures['fresh_iter0'])}  "
          f"target <= {FRESH_TARGET}: {met(figures['fresh_iter0'], FRESH_TARGET)}")
    if "base cold" in by:
        figures["base_cold_wall"] = ratios(by["base cold"], by["plain cold"], lambda r: r.wall_s)
        figures["base_fresh_iter0"] = ratios(by["base fresh"], by["plain warm"], lambda r: r.iter0_s)
        print(f"compare tree: cold wall / plain {spread(figures['base_cold_wall'])}, "
              f"fresh iter 0 / plain warm {spread(figures['base_fresh_iter0'])}")
    if "pc cold" in by:
        figures["pc_cold_wall"] = ratios(by["pc cold"], by["plain cold"], lambda r: r.wall_s)
        figures["pc_fallbacks"] = [r.precompile_fallbacks() for r in by["pc cold"] + by["pc fresh"]]
        dynamic = sum(f.get("dynamic_shapes", 0) for f in figures["pc_fallbacks"])
        figures["pc_shapes"] = [r.summed("precompile_shapes") for r in by["pc cold"] + by["pc fresh"]]
        plain = [loss for rank in by["plain cold"][0].losses for loss in rank]
        tier = [loss for rank in by["pc cold"][0].losses for loss in rank]
        figures["pc_max_loss_diff"] = max(abs(a - b) for a, b in zip(plain, tier))
        print(f"precompiled tier: cold wall / plain cold wall {spread(figures['pc_cold_wall'])}  "
              f"target <= {PRECOMPILE_COLD_TARGET}: {met(figures['pc_cold_wall'], PRECOMPILE_COLD_TARGET)}")
        print(f"precompiled tier: dynamic_shapes fallbacks {dynamic}; all its fallbacks, per run "
              f"{figures['pc_fallbacks']}; signatures served by kind, per run {figures['pc_shapes']}; "
              f"largest loss difference to plain cold {figures['pc_max_loss_diff']:.2e}")
        figures.update(precompile_fresh_figures(by["pc fresh"], by["plain warm"]))
        for pc, plain in zip(by["pc fresh"], by["plain warm"]):
            print(phases_table([plain, pc]))
    if "ns cold" in by:
        figures.update(no_stall_figures(by["ns cold"], by["ns fresh"], by["plain cold"]))
        sides = {"ns": by["ns cold"], **({"base ns": by["base ns cold"]} if "base ns cold" in by else {})}
        for side, runs in sides.items():
            figures[f"{side}_behind_span_s"] = [run.behind_span_s() for run in runs]
            figures[f"{side}_behind_compile_s"] = [run.seconds("compile") for run in runs]
            print(f"{side} cold: per rank, first graph sent behind to last compiled "
                  f"{[' '.join(f'{s:.1f}' for s in spans) for spans in figures[f'{side}_behind_span_s']]} s, "
                  f"of which compiling {[' '.join(f'{s:.1f}' for s in c) for c in figures[f'{side}_behind_compile_s']]} s")
        if "base ns cold" in by:
            figures["ns_wall_over_base_ns"] = ratios(by["ns cold"], by["base ns cold"], lambda r: r.wall_s)
            print(f"no-stall cold wall / the compare tree's no-stall cold wall: {spread(figures['ns_wall_over_base_ns'])}")
    print("losses: " + ("bitwise equal among runs without PGO state, among fresh runs and among the tier's runs"
                        if not mismatched else f"DIFFER in {', '.join(mismatched)}"))
    figures["losses_equal"] = not mismatched
    figures["scenarios"] = {
        scenario: {"wall_s": [r.wall_s for r in rs], "iter0_s": [r.iter0_s for r in rs],
                   "first_two_s": [r.first_two_s for r in rs], "iters_s": [r.iters_s for r in rs],
                   "in_steps_s": [r.critical_s for r in rs],
                   "compile_s": [r.seconds("compile") for r in rs], "wait_s": [r.seconds("wait") for r in rs],
                   "phases": [r.phases for r in rs]}
        for scenario, rs in by.items()}
    return figures


def precompile_fresh_figures(fresh: list[Run], warm: list[Run]) -> dict[str, Any]:
    """Print the tier's whole job of fresh ranks beside plain torchrun's warm job (per pair); returns the figures.

    An iteration after the first two takes 20-40 ms on 2 cores and jitters by some 10 ms between jobs (the
    ranks wait for each other at every step's allreduce, and any other process on the cores delays one of
    them), so the verdict on each later iteration reads its ratio's median over the pairs, beside each
    pair's. The main thread's CPU time per iteration (what the steps themselves cost, little disturbed by
    other processes) and where the later iterations' time went, part by part, are printed beside it.
    """
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    iters = [[f / w for f, w in zip(pc.iters_s, plain.iters_s)] for pc, plain in zip(fresh, warm)]
    cpu = [[f / w for f, w in zip(pc.iters_main_cpu_s, plain.iters_main_cpu_s)] for pc, plain in zip(fresh, warm)]
    for k, (pc, plain) in enumerate(zip(fresh, warm)):
        print(f"precompiled tier, fresh job {k}: iteration s (slowest rank) "
              + "  ".join(f"{i}: {f:.3f}/{w:.3f}" for i, (f, w) in enumerate(zip(pc.iters_s, plain.iters_s)))
              + f" (fresh/plain warm); wall {pc.wall_s:.1f}/{plain.wall_s:.1f} s; compiles {pc.compiles}; "
              f"fallbacks {pc.fallbacks() or 'none'}")
        for line in pc.fallback_details():
            print(f"    {line}")
    for k, (pc, plain) in enumerate(zip(fresh, warm)):
        shares = [run.others_share(2) for run in (pc, plain)]
        if None not in shares:
            print(f"  pair {k}: other processes' share of the cores during iterations 2 on, fresh / plain warm: "
                  f"{shares[0]:.0%} / {shares[1]:.0%}")
    later_iters = range(2, min(len(r) for r in iters))
    per_iter = [statistics.median(ratio[i] for ratio in iters) for i in later_iters]
    intervals = [median_interval([ratio[i] for ratio in iters]) for i in later_iters]
    per_iter_cpu = [statistics.median(ratio[i] for ratio in cpu) for i in later_iters]
    print("precompiled tier, fresh / plain warm per iteration after 1, median over the pairs (each pair's): "
          + "  ".join(f"{i}: {m:.2f} ({' '.join(f'{r[i]:.2f}' for r in iters)})" for i, m in zip(later_iters, per_iter)))
    print(f"  {MEDIAN_COVERAGE:.0%} interval of each median: "
          + "  ".join(f"{i}: {interval_text(span)}" for i, span in zip(later_iters, intervals)))
    together = ratios(fresh, warm, lambda r: sum(r.iters_s[2:])) if later_iters else []
    if together:
        print(f"  iterations 2 on together, fresh / plain warm: {spread(together)}, {MEDIAN_COVERAGE:.0%} interval "
              f"of the median {interval_text(median_interval(together))}")
    print("  main thread CPU per iteration, fresh / plain warm, median over the pairs: "
          + "  ".join(f"{i}: {m:.2f}" for i, m in zip(later_iters, per_iter_cpu)))
    parts = {side: {clock: {part: statistics.median(run.parts_s(clock, 2)[part] for run in runs) for part in ITER_PARTS}
                    for clock in ("parts", "parts_cpu")} for side, runs in (("fresh", fresh), ("plain warm", warm))}
    print("  iterations 2 on, ms per part (largest rank, median over the jobs), fresh / plain warm, wall | main CPU: "
          + "  ".join(f"{part} {parts['fresh']['parts'][part] * 1e3:.1f}/{parts['plain warm']['parts'][part] * 1e3:.1f}"
                      f" | {parts['fresh']['parts_cpu'][part] * 1e3:.1f}/{parts['plain warm']['parts_cpu'][part] * 1e3:.1f}"
                      for part in ITER_PARTS))
    unfair = process_differences(fresh[0].process_states(), warm[0].process_states())
    print(f"  ranks' processes, fresh vs plain warm (torch threads, OMP_NUM_THREADS, affinity, nice): "
          f"{'; '.join(unfair) if unfair else 'the same'}; threads {fresh[0].process_states()[0]['threads']} vs "
          f"{warm[0].process_states()[0]['threads']}")
    first_two = ratios(fresh, warm, lambda r: sum(r.iters_s[:2]))
    walls = ratios(fresh, warm, lambda r: r.wall_s)
    compiles, fallbacks = [r.compiles for r in fresh], [r.fallbacks() for r in fresh]
    slowest = max(per_iter, default=0.0)
    print(f"precompiled tier, fresh job / plain warm job: iterations 0+1 {spread(first_two)}  target <= "
          f"{PRECOMPILE_FRESH_TARGET}: {met(statistics.median(first_two) <= PRECOMPILE_FRESH_TARGET)} (goal "
          f"{PRECOMPILE_FRESH_GOAL}: {met(statistics.median(first_two) <= PRECOMPILE_FRESH_GOAL)}); wall {spread(walls)}  "
          f"target <= {PRECOMPILE_FRESH_WALL_TARGET}: {met(statistics.median(walls) <= PRECOMPILE_FRESH_WALL_TARGET)}; "
          f"slowest iteration after 1 (median over the pairs) "
          f"{f'{slowest:.2f}' if per_iter else 'none (run --iters 3 or more)'}  target <= "
          f"{PRECOMPILE_FRESH_ITER_TARGET}: {met(slowest <= PRECOMPILE_FRESH_ITER_TARGET)}"
          f"{'' if len(iters) >= 3 else ' (fewer than 3 pairs: run --warm-pairs 3 or more for a median)'} "
          f"({resolution(list(later_iters), intervals, PRECOMPILE_FRESH_ITER_TARGET)}); "
          f"compiles {compiles}, fallbacks {fallbacks}  target 0: {met(not any(compiles) and not any(fallbacks))}")
    return {"pc_fresh_first_two": first_two, "pc_fresh_wall": walls, "pc_fresh_iters": iters,
            "pc_fresh_iter_medians": per_iter, "pc_fresh_iter_median_intervals": intervals,
            "pc_fresh_later_iters_together": together, "pc_fresh_later_iter_max": slowest, "pc_fresh_main_cpu": cpu,
            "pc_fresh_main_cpu_medians": per_iter_cpu, "pc_fresh_parts_ms": parts,
            "pc_fresh_compiles": compiles, "pc_fresh_fallbacks": fallbacks,
            "pc_fresh_fallback_details": [r.fallback_details() for r in fresh]}


def resolution(iterations: list[int], intervals: list[tuple[float, float] | None], target: float) -> str:
    """Whether the pairs settle each later iteration's median against ``target``: every interval of
    :func:`median_interval` below it (within, at that coverage), one wholly above it (above), or else which
    iterations' intervals straddle it (more pairs narrow them). A single median of few noisy pairs, and the largest
    of several such medians, lands above the target by chance though the jobs run alike."""
    above = [i for i, span in zip(iterations, intervals) if span is not None and span[0] > target]
    if above:
        return f"iteration(s) {', '.join(map(str, above))} above {target}x at {MEDIAN_COVERAGE:.0%} confidence"
    open_ = [i for i, span in zip(iterations, intervals) if span is None or span[1] > target]
    if not open_:
        return f"every iteration within {target}x at {MEDIAN_COVERAGE:.0%} confidence"
    return (f"not settled at {MEDIAN_COVERAGE:.0%} confidence: iteration(s) {', '.join(map(str, open_))}; "
            "more --warm-pairs narrow the intervals")


def process_differences(one: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    """What differs between two jobs' ranks that would make their steps' times unfair to compare."""
    out = []
    for rank, (a, b) in enumerate(zip(one, other)):
        for what in ("torch_threads", "OMP_NUM_THREADS", "affinity", "nice"):
            if a.get(what) != b.get(what):
                out.append(f"rank {rank} {what} {a.get(what)} vs {b.get(what)}")
    return out


def no_stall_figures(cold: list[Run], fresh: list[Run], plain: list[Run]) -> dict[str, Any]:
    """Print no-stall's figures against plain torchrun cold (per repetition); returns them."""
    worst = [max(ns.worst_steps_s) / p.first_step_s for ns, p in zip(cold, plain)]
    per_rank = [[w / p.first_step_s for w in ns.worst_steps_s] for ns, p in zip(cold, plain)]
    walls = ratios(cold, plain, lambda r: r.wall_s)
    loss_diff = [max(abs(a - b) for mine, ref in zip(ns.losses, p.losses) for a, b in zip(mine, ref))
                 for ns, p in zip(cold, plain)]
    no_stall_failed = [sum(m.get("fallbacks", {}).get("no_stall_failed", 0) for m in r.metrics) for r in cold]
    fresh_compiles = [r.count("compile") for r in fresh]
    fresh_eager = [r.count("eager") for r in fresh]
    met = lambda value, limit: "met" if value <= limit else "MISSED"  # noqa: E731
    print(f"no-stall cold: slowest step / plain cold first step, per rank: "
          f"{'; '.join(' '.join(f'{v:.3f}' for v in ranks) for ranks in per_rank)}  "
          f"target <= {NO_STALL_STEP_TARGET}: {met(max(worst), NO_STALL_STEP_TARGET)} "
          f"(goal {NO_STALL_STEP_GOAL}: {met(max(worst), NO_STALL_STEP_GOAL)})")
    print(f"no-stall cold wall / plain cold wall: {spread(walls)}  target <= {NO_STALL_WALL_TARGET}: "
          f"{met(statistics.median(walls), NO_STALL_WALL_TARGET)}; eager calls {[r.count('eager') for r in cold]}, "
          f"compiles behind {[r.count('compile') for r in cold]}, switches {[r.count('switch') for r in cold]}")
    print(f"no-stall max |loss - plain cold loss| at any step: {' '.join(f'{d:.2e}' for d in loss_diff)}  "
          f"target <= {NO_STALL_LOSS_TARGET}: {met(max(loss_diff), NO_STALL_LOSS_TARGET)}")
    print(f"no-stall cold no_stall_failed: {no_stall_failed}  target 0: {'met' if not any(no_stall_failed) else 'MISSED'}")
    print(f"no-stall fresh ranks after: compiles {fresh_compiles}, eager calls {fresh_eager}  target 0: "
          f"{'met' if not any(fresh_compiles) and not any(fresh_eager) else 'MISSED'}")
    return {"ns_worst_step_over_plain_first": per_rank, "ns_cold_wall": walls, "ns_max_loss_diff": loss_diff,
            "ns_fresh_compiles": fresh_compiles, "ns_fresh_eager_calls": fresh_eager, "ns_no_stall_failed": no_stall_failed}


def run_case(work: Path, case: str, reps: int, warm_pairs: int, job_args: list[str], compare: Path | None,
             show: Callable[[Run], None], precompile: bool = False, no_stall: bool = False) -> list[Run]:
    """``reps`` interleaved repetitions of the scenarios; their order alternates between repetitions.

    The cold runs of a repetition come first (the warm ones need their dirs and stores),
    then ``warm_pairs`` rounds of the short warm runs (each fresh run in new empty dirs).
    """
    args = [*job_args, "--order", case]
    runs: list[Run] = []
    for rep in range(reps):
        base = work / f"{case}-{rep}"

        def job(scenario: str, dirs: str, store: str | None, tree: Path = ROOT, tag: str = "",
                launcher_args: Sequence[str] = ()) -> Callable[[], Run]:
            return lambda: run_job(work, scenario, case, f"{rep}{tag}", args, dirs=base / dirs,
                                   store=None if store is None else base / store, tree=tree, launcher_args=launcher_args)

        cold = [job("plain cold", "plain-dirs", None), job("rc cold", "rc-cold-dirs", "store")]
        if compare is not None:
            cold.append(job("base cold", "base-cold-dirs", "base-store", compare))
        if precompile:
            cold.append(job("pc cold", "pc-cold-dirs", "pc-store", launcher_args=["--precompile"]))
        if no_stall:
            cold.append(job("ns cold", "ns-cold-dirs", "ns-store", launcher_args=["--no-stall"]))
            if compare is not None:
                cold.append(job("base ns cold", "base-ns-cold-dirs", "base-ns-store", compare,
                                launcher_args=["--no-stall"]))
        warm = []
        for k in range(warm_pairs):
            pair = [job("rc fresh", f"rc-fresh-dirs-{k}", "store", tag=f".{k}"),
                    job("plain warm", "plain-dirs", None, tag=f".{k}")]
            if compare is not None:
                pair.append(job("base fresh", f"base-fresh-dirs-{k}", "base-store", compare, tag=f".{k}"))
            if precompile:
                pair.append(job("pc fresh", f"pc-fresh-dirs-{k}", "pc-store", tag=f".{k}", launcher_args=["--precompile"]))
            warm += pair if (rep + k) % 2 == 0 else pair[::-1]
        if rep % 2:
            cold.reverse()
        done = [start() for start in cold]
        done += [start() for start in warm]
        if no_stall:  # fresh ranks right after the no-stall cold job, on its store
            done.append(job("ns fresh", "ns-fresh-dirs", "ns-store", launcher_args=["--no-stall"])())
        runs += done
        for run in done:
            if run.scenario in ("rc cold", "base cold", "pc cold", "ns cold", "base ns cold"):
                show(run)
    return runs


def fresh_pairs(work: Path, case: str, pairs: int, job_args: list[str]) -> dict[str, Any]:
    """``pairs`` interleaved pairs of plain torchrun's warm job and the tier's fresh job (each in new empty dirs)
    on the plain cache and tier store an earlier run left in ``work`` (its first repetition's); prints and
    returns :func:`precompile_fresh_figures`. The issue-33 figures without the cold jobs, which take minutes
    each on a loaded machine, so many pairs fit in one sitting."""
    base = work / f"{case}-0"
    if not (base / "plain-dirs").is_dir() or not (base / "pc-store").is_dir():
        sys.exit(f"cold_bench: {base} holds no plain cache and tier store: run --precompile with --workdir {work} first")
    args = [*job_args, "--order", case]
    fresh: list[Run] = []
    warm: list[Run] = []
    for k in range(pairs):
        tag = f"fresh-only.{k}.{time.strftime('%H%M%S')}"
        sides = [lambda: warm.append(run_job(work, "plain warm", case, tag, args, dirs=base / "plain-dirs", store=None)),
                 lambda: fresh.append(run_job(work, "pc fresh", case, tag, args, dirs=base / f"pc-fresh-dirs-{tag}",
                                              store=base / "pc-store", launcher_args=["--precompile"]))]
        for side in sides if k % 2 == 0 else sides[::-1]:
            side()
    return precompile_fresh_figures(fresh, warm)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, help="interleaved repetitions per case (default 3; 1 with --quick)")
    p.add_argument("--cases", default="rotated,aligned", help="comma-separated: rotated, aligned (default both)")
    p.add_argument("--warm-pairs", type=int, default=2,
                   help="rounds of the short fresh-rank / plain-warm runs per repetition (default 2)")
    p.add_argument("--quick", action="store_true", help="a smaller job (1 layer, 3 lengths, 2 iterations), 1 repetition")
    p.add_argument("--lengths", help="sequence lengths (default 16,24,32,40; 16,24,32 with --quick)")
    p.add_argument("--iters", type=int, help="iterations per job (default 3; 2 with --quick)")
    p.add_argument("--timeline", action="store_true", help="print each recipecache cold job's per-rank timeline")
    p.add_argument("--workdir", type=Path, help="keep every run's dirs, stores and outputs here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.add_argument("--no-stall", action="store_true",
                   help="also run recipecache-run --no-stall cold (own store) and fresh ranks after it")
    p.add_argument("--tf32", action="store_true",
                   help="every job sets TF32 and the float32 matmul precision 'high' before it compiles")
    p.add_argument("--compare-tree", type=Path, metavar="DIR",
                   help="also run recipecache-run cold and fresh from this checkout (e.g. /work/main), interleaved")
    p.add_argument("--precompile", action="store_true",
                   help="also run recipecache-run --precompile cold and fresh (the precompiled tier), interleaved")
    p.add_argument("--fresh-only", action="store_true",
                   help="with --precompile and the --workdir of an earlier run: only the pairs of plain torchrun's warm "
                        "job and the tier's fresh job, on that run's plain cache and tier store (no cold job)")
    args = p.parse_args()
    if args.fresh_only and not (args.precompile and args.workdir):
        p.error("--fresh-only needs --precompile and the --workdir of an earlier --precompile run")
    sys.path.insert(0, str(ROOT))  # recipecache.runs.events, to read the runs' event logs
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in TARGETS for c in cases):
        p.error(f"--cases takes a comma-separated list of {', '.join(TARGETS)}")
    reps = args.reps or (1 if args.quick else 3)
    job_args = ["--lengths", args.lengths or ("16,24,32" if args.quick else "16,24,32,40"),
                "--iters", str(args.iters or (2 if args.quick else 3)), "--layers", "1" if args.quick else "2",
                *(["--tf32"] if args.tf32 else [])]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cold-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cold_bench: 2 ranks (gloo, CPU, 1 thread each), each in its own empty TORCHINDUCTOR_CACHE_DIR and TMPDIR; "
          f"job {' '.join(job_args)}; "
          f"{f'{args.warm_pairs} pair(s)' if args.fresh_only else f'{reps} repetition(s)'}; workdir {work}", flush=True)

    def show(run: Run) -> None:
        if args.timeline:
            print(timeline(run), flush=True)

    compare = args.compare_tree.resolve() if args.compare_tree else None
    if args.fresh_only:
        figures = {case: fresh_pairs(work, case, args.warm_pairs, job_args) for case in cases}
    else:
        figures = {case: summarise(case, run_case(work, case, reps, args.warm_pairs, job_args, compare, show,
                                                  args.precompile, args.no_stall))
                   for case in cases}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


def job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cold_bench.py job", description="the benchmark's training job (one rank)")
    p.add_argument("--lengths", default="16,24,32,40")
    p.add_argument("--order", choices=tuple(TARGETS), default="rotated")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--tf32", action="store_true", help="TF32 and float32 matmul precision 'high' before compiling")
    p.add_argument("--out", required=True)
    return p


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        job(job_parser().parse_args(sys.argv[2:]))
    else:
        main()
