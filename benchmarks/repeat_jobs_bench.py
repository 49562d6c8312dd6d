"""Nothing outlives its job, over many jobs: N small 2-rank ``recipecache-run`` jobs, one after the other.

Issue 28's target: 50 repeated jobs with ``--no-stall`` and ``--precompile`` on leave no
process behind, keep the store and the node directory within their configured caps, leave
the ``TMPDIR`` given to the jobs empty (but for torch's own precompiled-header cache, which
must not grow: :data:`TORCH_TMP`), and their run directories do not grow from job to job. Each job is the example's DDP model (``tests/workers/no_stall_train.py``, a couple of
steps over two sequence lengths) on 2 CPU ranks over gloo. The first job compiles cold
(a minute on a small machine); every later one runs on the warm store, with fresh ranks
(an empty ``TORCHINDUCTOR_CACHE_DIR`` per job, removed after it), as a new job would.

Layout under ``--dir`` (default: a new temp directory, kept if a check fails)::

    store/       the file store, file://...?max_size=--store-cap
    node/        the node directory (--node-dir), RECIPECACHE_NODE_MAX_SIZE=--node-cap
    tmp/         TMPDIR of every job: empty after each
    runs/jobN/   the run directory of job N
    inductor/    torch's local cache of the running job (removed after it)

After each job: the processes that carry the job's marker in their environment (the
launcher, torchrun, the ranks, no-stall workers, inductor's compile workers: every process
the job started inherits it), waited for at most ``--linger`` seconds to be gone; then the
sizes and ``TMPDIR``'s entries. While a job runs, its processes are read in ``/proc`` every
:data:`SAMPLE_S`: each one's peak RSS (``VmHWM``, the kernel's high-water mark, so no peak is
missed between readings) and open fds as last seen (its fds at exit, near enough), for the
launcher, the ranks (``launcher.bootstrap``) and the rest (torchrun, workers) apart; a leak
shows as growth from the first warm jobs to the last. Printed per job and in a summary, with
the checks::

    python benchmarks/repeat_jobs_bench.py [--jobs 50] [--dir DIR] [--store-cap 256MiB] [--node-cap 256MiB]

Exit status 1 if any check failed (a process left, a cap exceeded, ``TMPDIR`` not empty, a job
that failed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.paths import WORKERS
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipecache.sizes import parse_size  # noqa: E402

SCRIPT = WORKERS / "no_stall_train.py"
RANKS = 2
#: torch's own node-wide cache in $TMPDIR (``default_cache_dir()``, not TORCHINDUCTOR_CACHE_DIR): the
#: precompiled header of the ATen headers (150 MB) a cold kernel compile builds once and later compiles
#: reuse. Only $TMPDIR moves it, so it is allowed there, but it must not grow after it first appears.
TORCH_TMP = f"torchinductor_{getpass.getuser()}"
#: the environment variable whose value marks every process of one job
MARKER = "RECIPECACHE_REPEAT_BENCH_JOB"


def job_processes(marker: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


#: seconds between two readings of a running job's processes in /proc
SAMPLE_S = 0.5
#: what a job's processes are, by their command line: the launcher is the process the bench started
ROLES = ("launcher", "ranks", "others")


def role_of(pid: int, launcher: int) -> str:
    if pid == launcher:
        return "launcher"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "others"
    return "ranks" if b"launcher.bootstrap" in cmdline else "others"


def footprint(pid: int) -> tuple[int, int] | None:
    """``(peak RSS in bytes, open fds)`` of a live process, None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    hwm = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0")
    return int(hwm) * 1024, fds


class Footprints:
    """Each process of one job as last read: its role, peak RSS and fds; read until :meth:`stop`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.launcher = 0
        self.seen: dict[int, tuple[str, int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="footprints", daemon=True)

    def start(self, launcher: int) -> None:
        self.launcher = launcher
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for pid in job_processes(self.marker):
                read = footprint(pid)
                if read is not None:
                    role = self.seen[pid][0] if pid in self.seen else role_of(pid, self.launcher)
                    self.seen[pid] = (role, *read)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, tuple[int, int]]:
        """Per role: the largest peak RSS and the most fds last seen of any one process of it (0, 0 if none)."""
        out = {}
        for role in ROLES:
            mine = [(rss, fds) for r, rss, fds in self.seen.values() if r == role]
            out[role] = (max((m[0] for m in mine), default=0), max((m[1] for m in mine), default=0))
        return out


def size_of(path: Path) -> int:
    """Bytes of the regular files under ``path`` (no link followed)."""
    total = 0
    for directory, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total


def count_files(path: Path) -> int:
    return sum(len(files) for _d, _s, files in os.walk(path))


def run_job(base: Path, index: int, store_url: str, timeout: float) -> dict[str, object]:
    marker = f"{os.getpid()}-{index}-{secrets.token_hex(4)}"
    run_dir = base / "runs" / f"job{index}"
    inductor = base / "inductor"
    env = {**os.environ, MARKER: marker, "TMPDIR": str(base / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RECIPECACHE_URL", None)
    cmd = [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--master-port", str(free_port()),
           "--url", store_url, "--namespace", "repeat", "--node-dir", str(base / "node"),
           "--no-stall", "--precompile", "--quiet", "--run-dir", str(run_dir),
           str(SCRIPT), "--steps", "4", "--pause", "0", "--out", str(run_dir / "out.json")]
    start = time.perf_counter()
    footprints = Footprints(marker)
    with subprocess.Popen(cmd, env=env, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as launcher:
        footprints.start(launcher.pid)
        try:
            output, _ = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher.kill()
            output, _ = launcher.communicate()
        finally:
            footprints.stop()
    wall = time.perf_counter() - start
    left = job_processes(marker)
    deadline = time.monotonic() + ARGS.linger
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_processes(marker)
    shutil.rmtree(inductor, ignore_errors=True)
    tmp_entries = sorted(set(os.listdir(base / "tmp")) - {TORCH_TMP})
    return {
        "rc": launcher.returncode, "wall_s": wall, "left": left, "tmp": tmp_entries,
        "torch_tmp": size_of(base / "tmp" / TORCH_TMP),
        "store": size_of(base / "store"), "store_files": count_files(base / "store"),
        "node": size_of(base / "node"), "node_files": count_files(base / "node"),
        "run_dir": size_of(run_dir), "output": output, "footprint": footprints.summary(),
    }


def footprint_line(readings: list[tuple[int, int]]) -> str:
    """One role's peak RSS and fds at exit over the jobs: the largest, and the first warm jobs' median against
    the last jobs' (a leak grows from one to the other)."""
    first, last = readings[1:6] or readings, readings[-5:]
    return (f"peak RSS max {max(m for m, _ in readings) / 1e6:.0f} MB, median {statistics.median(m for m, _ in first) / 1e6:.0f} MB "
            f"(jobs 1-5) -> {statistics.median(m for m, _ in last) / 1e6:.0f} MB (last 5); fds at exit max "
            f"{max(f for _, f in readings)}, median {statistics.median(f for _, f in first):g} -> "
            f"{statistics.median(f for _, f in last):g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--dir", type=Path, help="where the store, node dir, TMPDIR and run dirs go (default: a new one)")
    p.add_argument("--store-cap", default="256MiB", help="the store's max_size")
    p.add_argument("--node-cap", default="256MiB", help="RECIPECACHE_NODE_MAX_SIZE")
    p.add_argument("--linger", type=float, default=10.0,
                   help="seconds a job's processes may take to be gone after its launcher exited")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    global ARGS
    ARGS = p.parse_args()
    store_cap, node_cap = parse_size(ARGS.store_cap), parse_size(ARGS.node_cap)
    base = ARGS.dir or Path(tempfile.mkdtemp(prefix="repeat-jobs-"))
    for sub in ("store", "node", "tmp", "runs"):
        (base / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ["RECIPECACHE_NODE_MAX_SIZE"] = str(node_cap)
    store_url = f"file://{base / 'store'}?max_size={store_cap}"
    print(f"{ARGS.jobs} jobs of {RANKS} ranks, --no-stall --precompile, in {base}; load {os.getloadavg()[0]:.1f}",
          flush=True)
    print(f"{'job':>4} {'rc':>3} {'wall s':>7} {'left':>4} {'tmp':>4} {'store MB':>9} {'files':>6} "
          f"{'node MB':>8} {'files':>6} {'run KB':>7} {'torch tmp MB':>12}  "
          + "  ".join(f"{role + ' MB/fds':>16}" for role in ROLES), flush=True)
    failures: list[str] = []
    results = []
    for index in range(ARGS.jobs):
        r = run_job(base, index, store_url, ARGS.timeout)
        results.append(r)
        print(f"{index:>4} {r['rc']:>3} {r['wall_s']:>7.1f} {len(r['left']):>4} {len(r['tmp']):>4} "
              f"{r['store'] / 1e6:>9.2f} {r['store_files']:>6} {r['node'] / 1e6:>8.2f} {r['node_files']:>6} "
              f"{r['run_dir'] / 1e3:>7.1f} {r['torch_tmp'] / 1e6:>12.1f}  "
              + "  ".join(f"{rss / 1e6:>11.0f}/{fds:<4}" for rss, fds in r["footprint"].values()),  # type: ignore[attr-defined]
              flush=True)
        if r["rc"] != 0:
            failures.append(f"job {index} exited {r['rc']}: {str(r['output'])[-2000:]}")
        if r["left"]:
            failures.append(f"job {index} left processes {r['left']}")
        if r["tmp"]:
            failures.append(f"job {index} left in TMPDIR: {r['tmp'][:10]}")
        before = max((int(e["torch_tmp"]) for e in results[:-1]), default=0)  # type: ignore[call-overload]
        if before and int(r["torch_tmp"]) > before:  # type: ignore[call-overload]
            failures.append(f"job {index}: torch's {TORCH_TMP} in TMPDIR grew {before} -> {r['torch_tmp']} bytes")
        if r["store"] > store_cap:
            failures.append(f"job {index}: store {r['store']} bytes over its cap {store_cap}")
        if r["node"] > node_cap:
            failures.append(f"job {index}: node directory {r['node']} bytes over its cap {node_cap}")
    warm = [float(r["wall_s"]) for r in results[1:]]  # type: ignore[arg-type]
    runs = [int(r["run_dir"]) for r in results]  # type: ignore[call-overload]
    print(f"\nsummary: {len(results)} jobs; processes left {sum(len(r['left']) for r in results)}; "  # type: ignore[arg-type]
          f"TMPDIR entries left {len(results[-1]['tmp'])} (besides torch's {TORCH_TMP}: "
          f"{results[-1]['torch_tmp'] / 1e6:.1f} MB); load {os.getloadavg()[0]:.1f}")
    print(f"  store {results[-1]['store'] / 1e6:.2f} MB of {store_cap / 1e6:.0f} MB cap, files after job 1 "
          f"{results[min(1, len(results) - 1)]['store_files']} -> last {results[-1]['store_files']}")
    print(f"  node directory {results[-1]['node'] / 1e6:.2f} MB of {node_cap / 1e6:.0f} MB cap, files after job 1 "
          f"{results[min(1, len(results) - 1)]['node_files']} -> last {results[-1]['node_files']}")
    print(f"  run dir per job: first {runs[0] / 1e3:.1f} KB, median {statistics.median(runs) / 1e3:.1f} KB, "
          f"last {runs[-1] / 1e3:.1f} KB")
    for role in ROLES:
        print(f"  {role}: {footprint_line([r['footprint'][role] for r in results])}")  # type: ignore[index]
    if warm:
        print(f"  warm job wall: median {statistics.median(warm):.1f} s, max {max(warm):.1f} s; "
              f"cold {float(results[0]['wall_s']):.1f} s")  # type: ignore[arg-type]
    for failure in failures:
        print("FAIL:", failure)
    if failures:
        print(f"kept {base} for a look")
        return 1
    print("all checks passed")
    if ARGS.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
