"""A peer that never answers, for the tests of what a client does when its server hangs."""

from __future__ import annotations

import socket
import threading


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
