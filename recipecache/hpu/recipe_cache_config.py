"""``PT_HPU_RECIPE_CACHE_CONFIG``: parse, format, and the per-rank environment the launcher sets.

The Intel Gaudi PyTorch bridge reads its on-disk recipe cache from this variable (Intel
Gaudi docs, "Runtime Environment Variables")::

    <RECIPE_CACHE_PATH>,<RECIPE_CACHE_DELETE>,<RECIPE_CACHE_SIZE_MB>[,<RECIPE_CACHE_ON_NFS>]

``DELETE`` clears the directory when the workload starts, ``SIZE_MB`` caps the directory
(the bridge evicts the oldest recipes by creation time past it), ``ON_NFS`` exists only
in newer releases (1.23 documents the default ``,false,1024,false``; 1.19 has three
fields). We accept one to four fields, missing ones taking the defaults, and write the
fourth only when it was given, so the value also suits bridges that know three fields.
Booleans are ``true``/``false`` in any case (Intel's examples use both ``True`` and
``true``). A size "MB" is taken as MiB (2**20 bytes); the docs do not say.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import quantities
from ..errors import ConfigError
from ..fsutil import private_directory
from ..keys import check_namespace

ENV_VAR = "PT_HPU_RECIPE_CACHE_CONFIG"
DEFAULT_MAX_SIZE_MB = 1024
#: the largest cap in MB taken: a petabyte, past any node's disk (the bridge reads it as a whole number)
MOST_SIZE_MB = 1 << 30
MIB = 1024 * 1024


@dataclass(frozen=True)
class RecipeCacheConfig:
    """One node-local recipe directory as the bridge sees it."""

    path: str
    delete: bool = False
    max_size_mb: int = DEFAULT_MAX_SIZE_MB
    #: None: the field is left out (bridges before 1.23 know three fields)
    on_nfs: bool | None = None

    @property
    def max_bytes(self) -> int:
        return self.max_size_mb * MIB


def _bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{ENV_VAR}: {name} must be true or false, got {text!r}")
    return value == "true"


def parse_config(text: str) -> RecipeCacheConfig:
    """The config in ``text``; ConfigError (one line) for anything the bridge would not take."""
    fields = text.split(",")
    if len(fields) > 4:
        raise ConfigError(
            f"{ENV_VAR}={text!r}: expected <path>,<delete true|false>,<max size MB>[,<on nfs true|false>]"
        )
    path = fields[0].strip()
    if not path:
        raise ConfigError(f"{ENV_VAR}={text!r}: the path is empty (the recipe disk cache is off)")
    delete = _bool("delete", fields[1]) if len(fields) > 1 else False
    size_text = fields[2].strip() if len(fields) > 2 else str(DEFAULT_MAX_SIZE_MB)
    size = quantities.whole(size_text, 1, MOST_SIZE_MB)
    if size is None:
        raise ConfigError(
            f"{ENV_VAR}: max size must be a whole number of MB from 1 to {MOST_SIZE_MB}, got {size_text!r}"
        )
    on_nfs = _bool("on_nfs", fields[3]) if len(fields) > 3 else None
    return RecipeCacheConfig(path, delete, size, on_nfs)


def format_config(config: RecipeCacheConfig) -> str:
    """The variable's value for ``config``; refuses what would not parse back the same."""
    if not config.path or "," in config.path:
        raise ConfigError(f"{ENV_VAR}: recipe directory {config.path!r} must be non-empty and contain no comma")
    if config.max_size_mb <= 0:
        raise ConfigError(f"{ENV_VAR}: max size must be positive, got {config.max_size_mb}")
    fields = [config.path, str(config.delete).lower(), str(config.max_size_mb)]
    if config.on_nfs is not None:
        fields.append(str(config.on_nfs).lower())
    return ",".join(fields)


def node_directory(namespace: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The node-local recipe directory: ``directory``, else ``$TMPDIR/recipecache-hpu-<uid>/<namespace>``.

    Local disk on purpose: Intel requires a shared recipe directory to sit on a local
    physical disk (the bridge's file locks are unreliable on NFS); nodes share through
    the store instead. The uid in the default keeps other users of a shared ``/tmp``
    from owning a parent of it.
    """
    if directory is not None:
        return Path(directory).expanduser().absolute()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"recipecache-hpu-{uid}" / check_namespace(namespace)


def rank_environment(
    local_rank: int,
    *,
    namespace: str,
    directory: str | os.PathLike[str] | None = None,
    delete: bool = False,
    max_size_mb: int = DEFAULT_MAX_SIZE_MB,
) -> dict[str, str]:
    """The environment one rank needs: ``{"PT_HPU_RECIPE_CACHE_CONFIG": ...}``.

    ``delete`` reaches local rank 0 only, because the directory is per node and every
    other rank clearing it would wipe recipes its neighbours just wrote. With a sync
    agent on the node leave ``delete`` False and start the agent with ``clear=True``:
    the bridge clears when the workload starts, which is after the agent has begun
    installing recipes from other nodes.
    """
    if local_rank < 0:
        raise ConfigError(f"local rank must be >= 0, got {local_rank}")
    config = RecipeCacheConfig(str(node_directory(namespace, directory)), delete and local_rank == 0, max_size_mb)
    return {ENV_VAR: format_config(config)}


def prepare_node_directory(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and refuse it unless only we can change it: recipes in it are code the device runs."""
    return private_directory(path, "recipe directory")
