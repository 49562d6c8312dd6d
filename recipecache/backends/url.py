"""A store URL, parsed once: scheme, location, and checked query options.

Every backend builds itself from a :class:`StoreURL` (``Backend.from_url``); this module
knows URL syntax and the shapes of option values (sizes, seconds, flags), never what a
backend does with them. Everything malformed is a :class:`ConfigError` of one line that
names the URL with its password hidden.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass, field

from .. import quantities
from ..env import positive_seconds
from ..errors import ConfigError, URLError, echo
from ..sizes import format_size, parse_size


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs, errors and reports."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # unparseable: hide everything between the scheme and the host
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url
    if password is None:
        return url
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def command_line_password_warning(url: str | None, option: str) -> str | None:
    """The warning for a store URL given as ``option`` with a password in it, or None.

    Process arguments are readable by every user of the machine (``ps``, ``/proc``), while
    the environment is readable by its owner and root only: ``RECIPECACHE_URL`` is the
    place for such a URL.
    """
    if not url:
        return None
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:  # malformed: the parse that follows reports it
        return None
    if not password:
        return None
    return (
        f"the password in {option} {redact(url)} is visible to every user of this machine (ps); "
        "set RECIPECACHE_URL instead"
    )


#: the highest database number a URL may name (Redis's SELECT takes a signed 32-bit index)
MOST_DATABASE = 2**31 - 1


@dataclass(frozen=True)
class StoreURL:
    """One store URL as given (``raw``), split into its parts; ``options`` are the query's ``key=value`` pairs
    (plus any defaults a caller added), and backends read options from here, not from ``parts.query``."""

    raw: str
    scheme: str
    parts: urllib.parse.SplitResult
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        try:
            parts = urllib.parse.urlsplit(url)
            if "," not in parts.netloc.rpartition("@")[2]:  # several hosts: hosts() checks each one
                parts.port  # noqa: B018 - raises ValueError for a non-numeric or out-of-range port
            options = dict(
                urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
            )
        except ValueError as exc:
            raise URLError(f"bad cache URL {echo(redact(url))}: {echo(str(exc), quote=False)}") from None
        if not parts.scheme:
            raise URLError(f"bad cache URL {echo(redact(url))}: it needs a scheme such as file:// or redis://")
        return cls(url, parts.scheme.lower(), parts, options)

    @property
    def redacted(self) -> str:
        return redact(self.raw)

    def error(self, problem: str) -> URLError:
        """A one-line error about this URL (a :class:`URLError`, which is a ConfigError)."""
        return URLError(f"bad cache URL {echo(self.redacted)}: {problem}")

    def check_options(self, known: Collection[str]) -> None:
        """Refuse options no backend of this scheme understands (a typo must not be ignored)."""
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise self.error(f"unknown option {echo(unknown[0])}; known: {', '.join(sorted(known)) or 'none'}")

    def with_defaults(self, known: Collection[str], **defaults: object) -> StoreURL:
        """This URL with each option of ``defaults`` added where the URL does not set it and ``known`` has it."""
        added = {k: str(v) for k, v in defaults.items() if k in known and k not in self.options}
        # ``raw`` stays as the user wrote it: it is what errors and reports show
        return StoreURL(self.raw, self.scheme, self.parts, {**self.options, **added}) if added else self

    def check_host(self, host: str) -> str:
        """``host`` if a resolver can be asked for it: at most 253 characters, each dot-separated label 1 to 63
        (IDNA's limits; the client raises outside them, from the first call instead of here), or an IPv6 literal."""
        if ":" in host:  # an IPv6 literal, from [...]
            return host
        try:
            if len(host) > 253:
                raise UnicodeError("longer than 253 characters")
            host.encode("idna")
        except UnicodeError as exc:
            raise self.error(f"bad host {echo(host)}: not a host name ({exc})") from None
        return host

    def hosts(self, default_port: int) -> list[tuple[str, int]]:
        """The ``host:port`` list of a location that names several (``h1:7000,h2:7000,[::1]:7001``),
        as cluster seed nodes and sentinels are given; a host without a port gets ``default_port``."""
        out = []
        for item in self.parts.netloc.rpartition("@")[2].split(","):
            if item.startswith("["):
                host, _, rest = item[1:].partition("]")
                port = rest.removeprefix(":") if rest.startswith(":") or not rest else "x"
            else:
                host, _, port = item.partition(":")
            number = quantities.whole(port, 1, 65535) if port else default_port
            if not host or number is None:
                raise self.error(f"bad host {echo(item)}: use host:port")
            out.append((self.check_host(host), number))
        return out

    def database(self, text: str, form: str) -> int:
        """The database number the URL's path names (``text``, 0 when empty), by the rule of
        :mod:`recipecache.quantities`; ``form`` shows where it goes (``/0``).

        Checked here because redis-py reads a path ``int()`` refuses (``/²``) as database 0,
        silently, and one it takes (``/٣``) as another number than the one every other reader sees.
        """
        number = quantities.whole(text, 0, MOST_DATABASE) if text else 0
        if number is None:
            raise self.error(f"bad database {echo(text)}: use a number from 0 to {MOST_DATABASE} such as {form}")
        return number

    # -- typed options -------------------------------------------------------------
    def size(self, name: str, default: int | None, bounds: tuple[int, int] | None = None) -> int | None:
        """Option ``name`` as a whole, positive number of bytes (``8MiB``, ``4096``), within ``bounds`` if given."""
        text = self.options.get(name)
        if text is None:
            return default
        try:
            exact = parse_size(text)
        except ConfigError as exc:
            raise self.error(f"option {name}: {exc}") from None
        if exact <= 0 or (bounds is not None and not bounds[0] <= exact <= bounds[1]):
            allowed = f" from {format_size(bounds[0])} to {format_size(bounds[1])}" if bounds else ""
            raise self.error(f"option {name}={echo(text)} must be a positive whole number of bytes{allowed}")
        return exact

    def seconds(self, name: str, default: float | None, bounds: tuple[float, float] | None = None) -> float | None:
        """Option ``name`` as a positive, finite number of seconds, within ``bounds`` if given."""
        text = self.options.get(name)
        if text is None:
            return default
        try:
            return positive_seconds(f"option {name}", text, bounds)
        except ConfigError as exc:
            raise self.error(str(exc)) from None
