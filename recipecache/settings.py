"""Store settings from arguments and the environment: which URL, namespace, secret, timeouts.

The URL itself is parsed by the backend it names (:mod:`recipecache.backends`). Environment: ``RECIPECACHE_URL`` (the URL), ``RECIPECACHE_DIR`` (the filesystem default's
directory, else ``~/.cache/recipecache``), ``RECIPECACHE_NAMESPACE``,
``RECIPECACHE_SECRET`` or ``RECIPECACHE_SECRET_FILE`` (the signing key), ``RECIPECACHE_WAIT_TIMEOUT``,
``RECIPECACHE_LEASE_TTL``, ``RECIPECACHE_NODE_DIR`` and ``RECIPECACHE_NODE_MAX_SIZE`` (the node
tier, :mod:`recipecache.node_tier`). Everything wrong here is a :class:`ConfigError` with one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import env, quantities
from .errors import ConfigError, echo
from .fsutil import open_named_file
from .keys import DEFAULT_NAMESPACE, check_namespace
from .sizes import parse_size

DEFAULT_WAIT_TIMEOUT = 600.0
DEFAULT_LEASE_TTL = 30.0
#: lease lifetimes accepted, in seconds: Redis keeps a lease in whole milliseconds, one
#: under a second is lost between its renewals (every third of it) on a busy machine, and
#: one over a day keeps a dead holder's lease from the others that long
LEASE_TTL_RANGE = (1.0, 86400.0)
#: size cap of a node directory unless ``RECIPECACHE_NODE_MAX_SIZE`` says otherwise
DEFAULT_NODE_MAX_SIZE = 20 * 1024**3
#: shortest signing key accepted
MIN_SECRET_BYTES = 16
#: largest key file read: a key is a few dozen bytes, and a path naming something endless (``/dev/zero``,
#: a log) must not be read until memory runs out
MAX_SECRET_FILE_BYTES = 64 * 1024
#: the on/off variables a rank reads (:func:`recipecache.env.switch`; ``RECIPECACHE_ENABLE`` the start-up hook)
RANK_SWITCHES = (env.PRECOMPILE, env.NO_STALL, env.PREWARM, env.METRICS_FLUSH, env.ENABLE)


def resolve_url(url: str | None = None) -> str:
    """The store URL: the argument, else ``$RECIPECACHE_URL``, else the filesystem store in
    ``$RECIPECACHE_DIR`` or ``~/.cache/recipecache``.

    The one place that order is written, so the library, the CLI, doctor and the launcher
    (which hands the result to every rank) agree on which store a process means.
    """
    if url:
        return url
    url = os.environ.get(env.URL)
    if url:
        return url
    directory = os.environ.get(env.DIR) or str(Path.home() / ".cache" / "recipecache")
    return "file://" + str(Path(directory).expanduser().absolute())


def resolve_namespace(namespace: str | None = None, *, default: str = DEFAULT_NAMESPACE) -> str:
    """The namespace: the argument, else ``$RECIPECACHE_NAMESPACE``, else ``default``; checked.

    ``default`` is the caller's fallback (the launcher's is the script's name); a bad
    namespace from any of the three is a one-line ConfigError.
    """
    return check_namespace(namespace or os.environ.get(env.NAMESPACE) or default)


def check_secret(value: bytes, source: str) -> bytes:
    """Refuse a signing key too short to sign with; ``source`` names where it came from.

    An empty key would silently turn signing off while the job believes it is on, and a
    short one can be guessed; ``deploy/README.md`` asks for at least 16 random bytes.
    """
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{source} is {'empty' if not value else f'{len(value)} bytes'}: "
            f"a signing key needs at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)"
        )
    return value


def read_secret(secret: str | bytes | None = None) -> bytes | None:
    """The signing key: the argument, else ``RECIPECACHE_SECRET``, else the file ``RECIPECACHE_SECRET_FILE``.

    None means unsigned; a key that is given but empty or short is a ConfigError.
    """
    if secret is not None:
        return check_secret(secret.encode() if isinstance(secret, str) else bytes(secret), "the secret")
    if env.SECRET in os.environ:
        return check_secret(os.environ[env.SECRET].encode(), env.SECRET)
    path = os.environ.get(env.SECRET_FILE)
    return read_secret_file(path, env.SECRET_FILE) if path else None


def read_secret_file(path: str | os.PathLike[str], source: str) -> bytes:
    """The key in file ``path`` (surrounding whitespace stripped); ``source`` names where the path came from.

    Only a regular file of at most :data:`MAX_SECRET_FILE_BYTES` is read: opening a FIFO
    blocks every process that opens the store until someone writes to it, and a device such
    as ``/dev/zero`` never ends, so neither is read (:func:`~recipecache.fsutil.open_named_file`).
    A symlink is followed: Kubernetes mounts a secret as one.
    """
    where = f"{source} {path}"
    with open_named_file(path, where) as f:
        try:
            value = f.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror}") from None
    if len(value) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_SECRET_FILE_BYTES} bytes, so not a key file")
    return check_secret(value.strip(), where)


@dataclass(frozen=True)
class StoreSettings:
    """Everything a :class:`~recipecache.store.Store` is built from, resolved and checked."""

    url: str
    namespace: str = DEFAULT_NAMESPACE
    secret: bytes | None = None
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    lease_ttl: float = DEFAULT_LEASE_TTL
    #: the node tier's directory (None: every lookup goes to the remote store)
    node_dir: str | None = None
    node_max_size: int = DEFAULT_NODE_MAX_SIZE

    def __post_init__(self) -> None:
        if self.secret is not None:
            check_secret(self.secret, "the secret")
        check_namespace(self.namespace)
        env.positive_seconds("wait_timeout", self.wait_timeout)
        env.positive_seconds("lease_ttl", self.lease_ttl, LEASE_TTL_RANGE)

    @classmethod
    def resolve(
        cls,
        url: str | None = None,
        *,
        namespace: str | None = None,
        secret: str | bytes | None = None,
    ) -> StoreSettings:
        return cls(
            url=resolve_url(url),
            namespace=resolve_namespace(namespace),
            secret=read_secret(secret),
            wait_timeout=env.seconds(env.WAIT_TIMEOUT, DEFAULT_WAIT_TIMEOUT),
            lease_ttl=lease_ttl(),
            node_dir=node_dir(),
            node_max_size=node_max_size(),
        )


def node_dir() -> str | None:
    """``$RECIPECACHE_NODE_DIR`` with ``{rank}`` replaced by this process's rank; None when unset or empty."""
    text = os.environ.get(env.NODE_DIR)
    return text.replace("{rank}", str(env.process_rank())) if text else None


def lease_ttl(environ: Mapping[str, str] | None = None) -> float:
    """``$RECIPECACHE_LEASE_TTL`` (checked against :data:`LEASE_TTL_RANGE`), else the default."""
    return env.seconds(env.LEASE_TTL, DEFAULT_LEASE_TTL, environ, bounds=LEASE_TTL_RANGE)


def node_max_size(environ: Mapping[str, str] | None = None) -> int:
    """``$RECIPECACHE_NODE_MAX_SIZE`` in bytes, else the default; ConfigError for anything but a positive size."""
    text = (os.environ if environ is None else environ).get(env.NODE_MAX_SIZE)
    if not text:
        return DEFAULT_NODE_MAX_SIZE
    try:
        size = parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{env.NODE_MAX_SIZE}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"{env.NODE_MAX_SIZE}={echo(text)} must be a positive size")
    return size


def check_rank_environment(environ: Mapping[str, str] | None = None) -> None:
    """Every setting a rank's ``enable()`` reads from ``environ`` (default: this process's), checked as the rank
    checks it; ConfigError with one line for the first bad one.

    The launcher checks what its ranks will be given before any starts, and ``recipecache
    doctor`` what this node's would read: a value every rank would stop on fails there first.
    The key (``RECIPECACHE_SECRET``/``_FILE``) is checked by each of them on its own.
    """
    environ = os.environ if environ is None else environ
    env.seconds(env.WAIT_TIMEOUT, DEFAULT_WAIT_TIMEOUT, environ)
    lease_ttl(environ)
    node_max_size(environ)
    env.cpu_fingerprint_override(environ)
    env.seconds(env.EXIT_GRACE, 0.0, environ)  # the rank's own default applies when it is unset
    env.seconds(env.NO_STALL_TIMEOUT, 0.0, environ)  # likewise: the no-stall compile deadline
    for name in RANK_SWITCHES:
        env.switch(name, environ)


#: the most processes, and threads per process, a node is given: far beyond any machine's cores (issue 28: --nproc
#: 10**20 hung the launcher, --threads 10**400 reached every rank's OMP_NUM_THREADS)
MOST_PER_NODE = 4096


def default_threads(environ: Mapping[str, str], *, several_per_node: bool) -> int | None:
    """The thread count every rank of a job gets unless told otherwise, the way torchrun picks it.

    The count enters torch's cache keys, so ranks must agree on it. torchrun keeps an existing
    ``OMP_NUM_THREADS`` and otherwise sets 1 when a node runs several processes; with one process it leaves
    torch's default (the core count, None here), which can differ between nodes. recipecache-run gives its ranks
    this, and the start-up hook gives it to ranks another launcher started (:mod:`recipecache.autoenable`).
    """
    text = environ.get("OMP_NUM_THREADS")
    if text:
        return quantities.whole_number("OMP_NUM_THREADS", text, 1, MOST_PER_NODE)
    return 1 if several_per_node else None


_NOT_IN_NAMESPACE = re.compile(r"[^A-Za-z0-9._-]+")


def namespace_for(script: Path) -> str:
    """The default namespace of a job: the script's stem, made a valid namespace.

    Stable across reruns of the same script (so they share artifacts) without any setup, and the same whichever
    launcher started the ranks (recipecache-run, or the start-up hook); ``--namespace`` or
    ``RECIPECACHE_NAMESPACE`` override it.
    """
    name = _NOT_IN_NAMESPACE.sub("-", script.stem).lstrip("._-")[:64]
    return name or "default"
