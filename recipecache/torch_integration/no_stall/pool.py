"""The worker pool of no-stall: one thread that runs this process's compiles behind the steps one after the other,
and the one worker process (:mod:`.worker`) it keeps for them.

A process keeps its one worker for all its graphs, as torch's own subprocess compile keeps its pool: torch's
import, the CPU's ISA pick and inductor's warm state are paid once, not per graph. A worker that died, or whose
state an earlier job left unfit (``stale_worker``), is replaced by a fresh one at the next job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ... import env
from ..metrics import Metrics
from .protocol import MAX_REPLY_BYTES, read_frame, write_frame


class CompileTimeout(RuntimeError):
    """A compile behind ran past its deadline; its worker was ended."""


class _Serial:
    """Runs submitted calls one after the other on one daemon thread.

    Not a ``ThreadPoolExecutor``: the interpreter joins those threads at exit *before* the
    ``atexit`` handlers run, so a stuck compile would hold the exit before :meth:`.controller.NoStall.finish`
    could apply the exit grace. A daemon thread is not joined; finish() waits for it, within the grace.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        #: calls submitted and not yet ended (queued or running)
        self.pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self.pending += 1
        self._queue.put((future, call))
        return future

    def _loop(self) -> None:
        while True:
            future, call = self._queue.get()
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(exc)
            finally:
                with self._lock:
                    self.pending -= 1


#: the directory that holds the ``recipecache`` package (this module's name says how deep it sits in it)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])


class _Worker:
    """This process's compile worker (:mod:`.worker`), kept for one graph after another.

    Each job travels on its stdin as one frame (:func:`write_frame`: the store settings, secret
    included, never touch the disk), its result comes back as one frame on its stdout; its own
    output goes to an unnamed temporary file whose tail explains a failure. End of file on its
    stdout means it died: the job in hand fails and the next job starts a new worker.
    """

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - kept open for the worker's life, closed in close()
        environ = dict(os.environ)
        for name in (env.EVENT_LOG, env.METRICS_FILE, env.METRICS_FLUSH):
            environ.pop(name, None)  # the parent records the background compile; the worker writes nothing of its own
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, environ.get("PYTHONPATH")) if p)
        self.expired = False
        # started in the package's root, which ``-m`` puts first on sys.path: never a module of the rank's directory.
        # In a process group of its own (this rank's session): a worker stopped (SIGSTOP) before it could ask to
        # die with the rank would otherwise outlive a rank killed meanwhile, stopped for good; the kernel ends
        # such a group when its parent dies (SIGHUP, then SIGCONT, to a group left orphaned with stopped members)
        own_group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}  # 3.10: none
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recipecache.torch_integration.no_stall.worker", str(os.getpid())],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=PACKAGE_ROOT,
            **own_group,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, payload: bytes, timeout: float) -> dict[str, Any]:
        """Have the worker compile one job within ``timeout`` seconds; its result, or raise why there is none
        (:class:`CompileTimeout` past the deadline, having ended the worker)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        log_start = os.fstat(self.log.fileno()).st_size
        timer = threading.Timer(min(timeout, threading.TIMEOUT_MAX), self._expire)
        timer.daemon = True
        timer.start()
        try:
            write_frame(self.proc.stdin, payload)
            reply = read_frame(self.proc.stdout, MAX_REPLY_BYTES)
        except OSError:  # a broken pipe: it is gone
            reply = None
        except ValueError as exc:
            self.kill()
            raise RuntimeError(f"the worker's reply was not one: {exc}; its worker was ended") from None
        finally:
            timer.cancel()
        if self.expired:
            raise CompileTimeout(
                f"the compile ran past its deadline ({timeout:g} s, {env.NO_STALL_TIMEOUT}); its worker was ended"
            )
        if reply is None:
            self.kill()
            tail = os.pread(self.log.fileno(), 600, max(log_start, os.fstat(self.log.fileno()).st_size - 600))
            text = tail.decode(errors="replace").strip()
            raise RuntimeError(f"worker exited with status {self.proc.returncode}" + (f": ...{text}" if text else ""))
        try:
            result = pickle.loads(reply)  # noqa: S301 - our own child's answer on our own pipe
        except Exception as exc:  # noqa: BLE001 - whatever the bytes were, the stream is out of step
            result = exc
        if not isinstance(result, dict):
            self.kill()
            raise RuntimeError(f"the worker's reply was not a result ({type(result).__name__}); its worker was ended")
        return result

    def _expire(self) -> None:
        self.expired = True
        self.kill()

    def kill(self) -> None:
        """End it now, mid-compile or not."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Let it exit at the end of its input (within ``timeout`` seconds, else end it)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


class WorkerPool:
    """This process's compiles behind: run one after the other on one thread, each in the kept worker.

    One compile at a time per process: forward and backward of one step would otherwise fight over the same
    cores; they finish one after the other, the first switching early.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._serial = _Serial("recipecache-behind")
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` (one compile behind) after those submitted before it."""
        return self._serial.submit(call)

    def idle(self) -> bool:
        """Whether nothing is queued or compiling here: a compile submitted now would start at once."""
        return self._serial.pending == 0

    def compile(self, payload: bytes, timeout: float, cancelled: Callable[[], bool]) -> dict[str, Any]:
        """Have the kept worker compile the pickled job ``payload`` within ``timeout`` seconds (starting one if none
        runs); its result, or raise why there is none. ``cancelled``: whether the process is exiting, which starts
        no worker any more."""
        deadline = time.monotonic() + timeout  # one deadline, a retry in a fresh worker included
        result = self._worker_for(cancelled).compile(payload, timeout)
        if result.get("stale_worker"):  # an earlier job's state stuck in the kept worker: again in a fresh one
            result = self._worker_for(cancelled, fresh=True).compile(payload, max(deadline - time.monotonic(), 0.0))
        return result

    def _worker_for(self, cancelled: Callable[[], bool], *, fresh: bool = False) -> _Worker:
        """The worker to compile a job: the kept one if it lives (and not ``fresh``), else a new one."""
        with self._lock:  # never a new worker once the job is cancelled: kill() follows the cancel, under this lock
            if cancelled():
                raise RuntimeError("the process was exiting")
            started = fresh or self._worker is None or not self._worker.alive()
            if started:
                if self._worker is not None:
                    self._worker.close(0.0)
                self._worker = _Worker()
            worker = self._worker
        if started:
            self._metrics.no_stall(workers=1)  # not under a lock: a metrics flush reads no-stall's snapshot
        return worker  # type: ignore[return-value]  # made above if there was none

    def kill(self) -> None:
        """End the kept worker now, mid-compile or not: its job fails (past the exit grace)."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Let the kept worker exit at the end of its input (:meth:`_Worker.close`); a later job starts a new one."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
