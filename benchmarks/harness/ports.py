"""Free TCP ports on 127.0.0.1, for the servers and rendezvous a test or benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free now; another process may take it before the caller binds it (:class:`RedisServer` retries)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_below(limit: int) -> int:
    """A free port no higher than ``limit`` (Redis refuses cluster nodes on ports above 55535)."""
    for _ in range(1000):
        port = free_port()
        if port <= limit:
            return port
    raise RuntimeError(f"no free port below {limit}")
