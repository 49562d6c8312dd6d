"""Every Redis failure as a :class:`BackendError`, and which of them concern one call's keys rather than the service.

``backend_down`` (connection), ``backend_slow`` (no answer in time), ``backend_full`` (OOM
under ``maxmemory``) or ``backend_error``. A failure of the keys of one call rather than of
the service (a key of another type, a hash slot in migration: :func:`concerns_keys`) is a
:class:`BackendKeyError`: that key misses, the store's circuit breaker stays closed.
"""

from __future__ import annotations

import re

import redis
import redis.exceptions

from ...errors import BackendError, BackendKeyError
from ...reasons import Reason

#: Error replies about the keys of one command, not the service: a key of another type, keys in
#: several hash slots, a slot in migration (TRYAGAIN while its keys move, MOVED/ASK redirections)
_KEY_ERROR_CODES = frozenset({"WRONGTYPE", "CROSSSLOT", "TRYAGAIN", "MOVED", "ASK"})
#: how redis-py's cluster client raises those (the code stripped from the message)
_KEY_ERRORS = (redis.exceptions.TryAgainError, redis.exceptions.AskError, redis.exceptions.ClusterCrossSlotError)
#: what redis-py puts before the reply of a failed command in a pipeline's error
_PIPELINE_ERROR = re.compile(r"\ACommand # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


def concerns_keys(exc: Exception) -> bool:
    """Whether ``exc`` is a failure of the keys of one call, which the service answered.

    redis-py's cluster client follows MOVED/ASK/TRYAGAIN replies itself and raises a plain
    ``ClusterError`` ("TTL exhausted") when a slot keeps redirecting or refusing: a slot in
    migration, one hash slot's problem.
    """
    if type(exc) is redis.exceptions.ClusterError or isinstance(exc, _KEY_ERRORS):
        return True
    if not isinstance(exc, redis.exceptions.ResponseError):
        return False
    code = _PIPELINE_ERROR.sub("", str(exc)).partition(" ")[0]
    return code in _KEY_ERROR_CODES


def redis_error(exc: Exception, what: str) -> BackendError:
    """The BackendError (or BackendKeyError) a failed call ``what`` raises for redis-py's ``exc``."""
    reason: Reason
    if isinstance(exc, redis.exceptions.TimeoutError):
        reason = Reason.BACKEND_SLOW
    elif isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError)):
        reason = Reason.BACKEND_DOWN
    elif isinstance(exc, redis.exceptions.OutOfMemoryError) or (  # the class also inside a pipeline ("Command # n")
        isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("OOM")
    ):
        reason = Reason.BACKEND_FULL
    elif concerns_keys(exc):
        return BackendKeyError(Reason.BACKEND_ERROR, f"redis {what}: {exc}")
    else:
        reason = Reason.BACKEND_ERROR
    return BackendError(reason, f"redis {what}: {exc}")
