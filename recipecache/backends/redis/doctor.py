"""What ``recipecache doctor`` asks of a Redis store: may the user run every command the backend sends, and the clock.

The backend hands in how it runs a command (on a key, and keyless: a cluster sends that to
one node); a cluster adds the commands its client sends to follow the slots
(:meth:`~recipecache.backends.redis.RedisBackend._acl_probes`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.exceptions

from ...health import FAIL, PASS, WARN, HealthCheck
from .errors import redis_error

#: Every command this backend sends, as ACL names; deploy/ builds its ACL user from this
#: list. redis-py also sends ``CLIENT SETINFO`` on connect (Redis >= 7.2) and ignores a
#: refusal, so the user needs no ``client`` rights. Lua scripts run with the caller's
#: rights, so their commands are listed too.
ACL_COMMANDS = (
    "get",
    "getrange",
    "strlen",
    "set",
    "del",
    "mget",
    "scan",
    "pexpire",
    "persist",
    "pttl",
    "rpush",
    "blmove",
    "evalsha",
    "script|load",
    "ping",
    "auth",
    "hello",
)

#: Clock difference to the server above which event timelines of several hosts no longer line up
#: (leases are unaffected: they expire on the server's clock)
MAX_CLOCK_SKEW_S = 1.0
_DOCTOR_SCRIPT = "return 1"

#: how a probe runs a command: on a key, or keyless
Run = Callable[..., Any]


def acl_probes(key: str, run: Run, keyless: Run, connection: Mapping[str, Any]) -> dict[str, Callable[[], Any]]:
    """One harmless call of each command in :data:`ACL_COMMANDS` on ``key``, in an order that works (``del`` last).

    The list commands of waiting (``rpush``, ``blmove``) go to a list beside ``key``
    (same hash tag on a cluster), which ``del`` removes with it. ``connection`` is what the
    client's connections are made with: ``auth`` sends its user name (if any) and password.
    """
    credentials = [connection[k] for k in ("username", "password") if connection.get(k)]
    credentials = credentials if connection.get("password") else []
    wake = key + ":doctor-wake"
    return {
        "ping": lambda: keyless("PING"),
        "hello": lambda: keyless("HELLO", 2),
        "auth": lambda: keyless("AUTH", *credentials) if credentials else None,
        "set": lambda: run("SET", key, b"recipecache doctor", "PX", 60_000),
        "get": lambda: run("GET", key),
        "getrange": lambda: run("GETRANGE", key, 0, 3),
        "strlen": lambda: run("STRLEN", key),
        "mget": lambda: run("MGET", key),
        "pexpire": lambda: run("PEXPIRE", key, 60_000),
        "persist": lambda: run("PERSIST", key),
        "pttl": lambda: run("PTTL", key),
        "rpush": lambda: run("RPUSH", wake, b"1"),
        "blmove": lambda: run("BLMOVE", wake, wake, "RIGHT", "LEFT", 0.01),
        "scan": lambda: keyless("SCAN", 0, "MATCH", key, "COUNT", 10),
        "script|load": lambda: keyless("SCRIPT", "LOAD", _DOCTOR_SCRIPT),
        "evalsha": lambda: run("EVALSHA", hashlib.sha1(_DOCTOR_SCRIPT.encode()).hexdigest(), 1, key),
        "del": lambda: run("DEL", key, wake),
    }


def acl_check(probes: Mapping[str, Callable[[], Any]]) -> HealthCheck:
    """A real call per command: ``ACL DRYRUN`` needs rights a job user must not have."""
    refused = []
    for command, probe in probes.items():
        try:
            probe()
        except redis.exceptions.NoPermissionError:
            refused.append(command)
        except redis.exceptions.ResponseError:
            pass  # an answer other than a refusal: the user may run it (e.g. HELLO on an old server)
        except redis.exceptions.RedisError as exc:
            error = redis_error(exc, command)
            return HealthCheck(
                "acl",
                FAIL,
                f"could not check the user's rights: {error.reason}: {error}",
                "make the server reachable first",
            )
    if refused:
        grants = " ".join(f"+{c}" for c in refused)
        return HealthCheck(
            "acl",
            FAIL,
            f"the user may not run {', '.join(refused)}",
            f"ACL SETUSER <user> {grants} (deploy/redis/users.acl.template grants what the backend sends)",
        )
    return HealthCheck("acl", PASS, f"the user may run all {len(probes)} commands the backend sends on rc:* keys")


def clock_check(keyless: Run) -> HealthCheck:
    """This host's clock against the server's ``TIME``: timelines of several hosts line up only when they agree."""
    before = time.time()
    try:
        seconds, micros = keyless("TIME")
    except redis.exceptions.NoPermissionError:
        return HealthCheck(
            "clock",
            PASS,
            "not measured (the user may not run TIME); Redis leases expire on the "
            "server's clock, so client clocks do not affect them",
        )
    except redis.exceptions.RedisError as exc:
        return HealthCheck("clock", FAIL, f"TIME failed: {exc}", "make the server reachable first")
    skew = (before + time.time()) / 2 - (int(seconds) + int(micros) / 1e6)
    detail = f"this host's clock is {skew:+.3f} s off the server's"
    if abs(skew) > MAX_CLOCK_SKEW_S:
        return HealthCheck(
            "clock",
            WARN,
            detail + " (leases are unaffected; timelines of several hosts are skewed)",
            "synchronise the clocks (NTP)",
        )
    return HealthCheck("clock", PASS, detail)
