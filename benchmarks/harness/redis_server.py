"""A real redis-server for tests and benchmarks: started on 127.0.0.1 on a free port, in a temp dir.

CI installs ``redis-server`` (README's test command); a missing binary is an error,
never a skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

from harness.ports import free_port

#: how many free ports a server that chose its own tries (see :meth:`RedisServer.start`)
PORT_TRIES = 5


class PortTaken(RuntimeError):
    """Another process bound the port first."""


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` simulate an outage on the same port."""

    def __init__(self, workdir: Path, *, config: str = "", port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run README's test command, which installs it")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.own_port = port is None  # chosen here: replaceable, until the first start hands out its URL
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start redis-server and return once this process serves its port. Another process may take a port between
        :func:`free_port` and redis-server's bind (a busy machine runs other jobs): a port chosen here is then
        replaced by another, before the first start only (a restart keeps the port its clients hold)."""
        for _ in range(PORT_TRIES):
            try:
                self._start_on_port()
            except PortTaken:
                if not self.own_port:
                    raise
                self.port = free_port()
                continue
            self.own_port = False
            return
        raise RuntimeError(f"redis-server found {PORT_TRIES} free ports taken before it could bind them")

    def _start_on_port(self) -> None:
        """Ready once this process's own log says so: a reply on the port alone could be another process's, one
        that took the port while this one failed to bind it."""
        conf, log = self.workdir / "redis.conf", self.workdir / "redis.log"
        conf.write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {self.workdir}\nsave \"\"\nappendonly no\n"
            f"protected-mode yes\nlogfile {log}\n{self.config}\n"
        )
        self.proc = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        own = re.compile(rf"^{self.proc.pid}:[A-Z] .*$", re.MULTILINE)  # its lines, not an earlier start's
        deadline = time.monotonic() + 120  # a hang guard: it waits for the server's own word
        while time.monotonic() < deadline:
            text = "\n".join(own.findall(log.read_text(errors="replace"))) if log.exists() else ""
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.proc = None
                if "Address already in use" in text:
                    raise PortTaken(f"port {self.port} was taken by another process: {text[-500:]}")
                raise RuntimeError(f"redis-server exited: {err} {text[-2000:]}")
            if "Ready to accept connections" in text:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
