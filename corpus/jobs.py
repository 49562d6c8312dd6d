"""Run a corpus program as a user would, plain or through recipecache, and read back what came of it.

The tests (``tests/corpus``) and the benchmark (``benchmarks/corpus_bench.py``) both start jobs
through :func:`run_job`: plain torchrun (what a user runs instead) or ``recipecache-run`` in one of
:data:`MODES`, every rank in its own empty torch cache and temp directory (``--rank-dirs``, as on
its own node), so ranks share nothing but the store. A job's record is its exit status, wall time,
every rank's losses and step times (the program's ``--out``), and for recipecache the job report
and the ranks' metrics.

This module imports neither torch nor recipecache: it only starts processes and reads files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent
ROOT = CORPUS.parent


@dataclass(frozen=True)
class Program:
    """One program of the corpus: its script, how many ranks it runs on, and the framework it is written for."""

    name: str
    #: the distributions it imports, as pinned in pyproject.toml's ``corpus`` extra
    framework: str
    nproc: int = 2
    #: its smallest configuration's arguments (the tests run this one)
    small: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return CORPUS / f"{self.name}.py"


#: every program, in the order the benchmark's table lists them
PROGRAMS: dict[str, Program] = {
    p.name: p
    for p in (
        Program("lightning_ddp", "pytorch-lightning 2.6.6"),
        Program("accelerate_lm", "accelerate 1.15.0"),
        Program("hf_trainer_gpt2", "transformers 5.24.0 (Trainer)", small=("--steps", "2")),
        # one size: ResNet's graphs take minutes to compile on 2 cores (the benchmark runs both sizes)
        Program("torchvision_resnet", "torchvision 0.29.2", small=("--steps", "2", "--lengths", "32")),
        Program("pyg_gcn", "torch-geometric 2.8.1", small=("--steps", "2")),
        # one resolution: the UNet's graphs take minutes to compile on 2 cores (the benchmark runs both)
        Program("diffusers_unet", "diffusers 0.42.1", small=("--steps", "2", "--lengths", "16")),
        Program("generate_kv", "transformers 5.24.0 (generate)", small=("--steps", "1")),
        # 4 ranks: not in tests/corpus (2 cores); tests/torch_integration/test_collectives.py runs this block
        Program("fsdp_tp", "torch.distributed FSDP2 + tensor parallel", nproc=4),
    )
}

#: recipecache-run's options for each mode; None: plain torchrun, no recipecache (``eager``: with torch.compile
#: off, ``TORCHDYNAMO_DISABLE=1``: torch's own eager results, beside which no-stall's steps without inductor are judged)
MODES: dict[str, tuple[str, ...] | None] = {
    "plain": None,
    "eager": None,
    "store": (),
    "precompile": ("--precompile",),
    "no_stall": ("--no-stall",),
    "both": ("--precompile", "--no-stall"),
}


@dataclass
class Job:
    program: str
    mode: str
    exit_code: int
    wall_s: float
    #: the end of the job's output (stdout and stderr), for a failure's message (the whole of it: ``<work>/<name>.log``)
    output: str
    #: each rank's record: ``losses`` and ``step_end_s`` (seconds since the program began to train)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: recipecache-run's report (report.json); None for plain torchrun
    report: dict[str, Any] | None = None
    #: each rank's metrics file
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[list[float]]:
        return [r["losses"] for r in self.ranks]

    @property
    def first_two_s(self) -> float | None:
        """Iterations 0 and 1 of the slowest rank: from the start of training to the end of its second step."""
        ends = [r["step_end_s"][min(1, len(r["step_end_s"]) - 1)] for r in self.ranks if r["step_end_s"]]
        return max(ends) if ends else None

    def total(self, name: str) -> Any:
        return (self.report or {}).get("total", {}).get(name)

    @property
    def compiles(self) -> int | None:
        """Graphs compiled on the ranks' paths and behind them (no-stall's workers, the report counts those apart)."""
        inline = self.total("compiles")
        if inline is None:
            return None
        return int(inline) + sum(int((m.get("no_stall") or {}).get("compiles") or 0) for m in self.metrics)

    @property
    def fallbacks(self) -> dict[str, int]:
        return dict(self.total("fallbacks") or {})

    @property
    def precompile_fallbacks(self) -> Counter[str]:
        """The precompiled tier's fallbacks by detail (``load_failed``, ``graph_break``...), summed over ranks."""
        found: Counter[str] = Counter()
        for m in self.metrics:
            found.update(m.get("precompile_fallbacks") or {})
        return found

    @property
    def fallback_details(self) -> list[str]:
        """Each rank's fallback details, one line each (the tier's, with the error torch raised)."""
        lines = []
        for m in self.metrics:
            for d in m.get("precompile_fallback_details") or []:
                lines.append(f"{d.get('detail')}: {d.get('message')} {d.get('error') or ''}".strip())
        return lines

    def describe(self) -> str:
        return f"{self.program} {self.mode}: exit {self.exit_code}\n{self.output}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    program: Program,
    mode: str,
    *,
    work: Path,
    dirs: Path,
    store: Path | None = None,
    args: tuple[str, ...] | None = None,
    python: str = sys.executable,
    timeout: float = 1500.0,
    tag: str = "",
) -> Job:
    """One job of ``program`` in ``mode``, every rank in ``dirs``/rank<R>, recipecache's store in ``store``.

    ``args``: the program's arguments (default its smallest configuration); ``tag`` names this job's
    files under ``work`` (default the mode). A job that runs past ``timeout`` is killed and recorded
    with exit status -9.
    """
    launcher = MODES[mode]
    name = f"{program.name}-{tag or mode}"
    out, run_dir = work / f"{name}-out", work / f"{name}-run"
    script = [str(program.script), *(program.small if args is None else args), "--out", str(out)]
    port = ["--master-port", str(free_port())]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_", "OMP_"))}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    if launcher is None:
        # torchrun as a user runs it; the launcher's bootstrap only gives each rank its own torch cache and
        # temp directories before torch is imported (recipecache stays off)
        environ["RECIPECACHE_RANK_DIRS"] = str(dirs)
        if mode == "eager":
            environ["TORCHDYNAMO_DISABLE"] = "1"
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(program.nproc), *port]
        cmd += ["-m", "launcher.bootstrap", *script]
    else:
        if store is None:
            raise ValueError(f"mode {mode} needs a store")
        cmd = [python, "-m", "launcher.main", "--nproc", str(program.nproc), *port, "--url", f"file://{store}"]
        cmd += ["--namespace", f"corpus-{program.name}", "--run-dir", str(run_dir), "--rank-dirs", str(dirs)]
        cmd += [*launcher, *script]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=environ, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = -9, f"killed after {timeout:.0f} s\n{_text(exc.stdout)}{_text(exc.stderr)}"
    wall = time.perf_counter() - start
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.log").write_text(output)  # whole: a failing rank's traceback may sit far above the report
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("losses-rank*.json"), key=_rank_of)]
    report_file = run_dir / "report.json"
    report = json.loads(report_file.read_text()) if launcher is not None and report_file.exists() else None
    metrics = [json.loads(p.read_text()) for p in sorted(run_dir.glob("metrics-rank*.json"))]
    return Job(program.name, mode, code, wall, output[-6000:], ranks, report, metrics)


def _rank_of(path: Path) -> int:
    return int(path.stem.removeprefix("losses-rank"))


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
