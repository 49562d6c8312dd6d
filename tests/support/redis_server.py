"""A real redis-server for tests: started on 127.0.0.1 on a free port, in a temp dir.

CI installs ``redis-server`` (README's test command); a missing binary is an error,
never a skip.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        conf = self.workdir / "redis.conf"
        conf.write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {self.workdir}\nsave \"\"\nappendonly no\n"
            f"protected-mode yes\nlogfile {self.workdir / 'redis.log'}\n{self.config}\n"
        )
        self.proc = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120  # a hang guard: it waits for the port to answer
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited: {err} {log[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
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


class HungPeer:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers: a hung Redis server
    or sentinel (a stopped process, a half-open path). Its sockets stay open until ``close``."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="hung-peer", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._accepted.append(conn)

    @property
    def connections(self) -> int:
        """How many connections it accepted so far."""
        return len(self._accepted)

    def close(self) -> None:
        self._listener.close()
        for conn in self._accepted:
            conn.close()

    def __enter__(self) -> HungPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
