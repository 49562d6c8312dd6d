"""Exceptions of recipecache.

Two families matter to callers:

* :class:`ConfigError` is bad *input* (a malformed URL, an unknown option, an unusable
  directory). It is raised at configuration time and the CLIs turn it into a one-line
  error with exit status 2.
* :class:`BackendError` is a backend that is down, slow, full or otherwise unusable at
  run time. The store never lets it reach training code: it degrades to a local compile
  and counts ``reason``.
"""

from __future__ import annotations

from .reasons import Reason

#: how many characters of a value given by the user an error line repeats
ECHO_CHARS = 80


def echo(value: str, *, quote: bool = True) -> str:
    """``value`` for an error line (quoted, unless ``quote`` is false: a message of another
    library that repeats the value), cut to its first :data:`ECHO_CHARS` characters.

    An error is one line a person reads: a 400-character URL or namespace repeated in full
    buries what the line says about it, and its start is enough to tell which value it was.
    """
    shown = repr(value[:ECHO_CHARS]) if quote else value[:ECHO_CHARS]
    return shown if len(value) <= ECHO_CHARS else f"{shown}... ({len(value)} chars)"


class RecipeCacheError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(RecipeCacheError, ValueError):
    """Bad configuration or input; the message is one readable line."""


class URLError(ConfigError):
    """A store URL that is malformed in itself (syntax, scheme, options), as opposed to one naming
    something unusable (a directory others can write): ``recipecache doctor`` reports the latter
    as a failed check and exits 2 only for the former."""


class BackendError(RecipeCacheError):
    """A backend operation failed; ``reason`` is the counted miss/fallback reason."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BackendKeyError(BackendError):
    """A backend failure confined to the keys of one call (a Redis key of another type, a hash slot in
    migration): that key misses, counted under ``reason``, but the service answered, so the store's
    circuit breaker stays closed and every other key goes on being served."""


class VerificationError(RecipeCacheError):
    """An envelope failed its checksum, signature or format check.

    ``reason`` is one of :data:`recipecache.reasons.REFUSED`: ``corrupt`` (damaged or
    truncated bytes), ``unsigned`` / ``bad_signature`` (refused because a secret is
    configured), ``old_format``.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
