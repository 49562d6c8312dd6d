"""Where the filesystem store keeps each thing under its root, every path made through the root's held fd.

Layout under the root::

    objects/<namespace>/<hex[:2]>/<hex>        one file per entry
    leases/<namespace>/<hex>.lease             a lease: JSON {"token", "expires"}
    leases/<namespace>/<hex>.lease.lock        the lock a lease is taken over, renewed and released under
    leases/<namespace>/<hex>.value.lock        the lock that orders conditional writes of an entry
    .evict.lock                                one eviction at a time

The root must not be writable by group or others (anyone who can write the cache can run
code on every rank), and no path under it is followed through a symlink. It is checked again
before each use, not only when the store opens: removed mid-job (a tmp cleaner), it may come
back as someone else's (:class:`~recipecache.fsutil.PrivateDirectory`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import BackendError, ConfigError
from ..fsutil import PrivateDirectory
from ..reasons import Reason
from .base import check_key


class Layout:
    """The paths of one store directory; a path handed out lies under a root checked just before."""

    def __init__(self, root: str | os.PathLike[str], what: str) -> None:
        self._root = PrivateDirectory(root, what)
        self.root = self._root.root

    def checked_root(self) -> Path:
        """The root as a path through its held fd, checked again if its name changed since it was checked
        (:class:`PrivateDirectory`); every path under it is made from this, so nothing is read from, or written
        to, a directory that is not private, even one swapped in between a check and a use."""
        try:
            return self._root.path()
        except ConfigError as exc:
            raise BackendError(Reason.BACKEND_ERROR, str(exc)) from None

    def shown(self, path: Path) -> Path:
        """``path`` under the root's name, for messages (it is used through the root's held fd)."""
        return self.root.joinpath(*path.parts[5:]) if path.parts[1:4] == ("proc", "self", "fd") else path

    def directory(self, *parts: str) -> Path:
        """``root/parts...``, created 0700, refusing any component that is a symlink."""
        path = self.checked_root()
        for part in parts:
            path = path / part
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise BackendError(
                        Reason.BACKEND_ERROR, f"{self.shown(path)} is a symlink or not a directory; refusing it"
                    ) from None
        return path

    def object_path(self, key: str) -> Path:
        """The file of entry ``key`` (its directory may not exist yet)."""
        namespace, digest = check_key(key).split("/")
        return self.checked_root() / "objects" / namespace / digest[:2] / digest

    def new_object_path(self, key: str) -> Path:
        """The file of entry ``key``, in a directory created if it was not there: for a write."""
        namespace, digest = check_key(key).split("/")
        return self.directory("objects", namespace, digest[:2]) / digest

    def lease_path(self, name: str) -> Path:
        """The lease file of ``name`` (its directory may not exist yet)."""
        namespace, digest = check_key(name).split("/")
        return self.checked_root() / "leases" / namespace / f"{digest}.lease"

    def value_lock_path(self, key: str) -> Path:
        """The lock file that orders conditional writes of entry ``key``, in a directory created if need be."""
        namespace, digest = key.split("/")
        return self.directory("leases", namespace) / f"{digest}.value.lock"

    def evict_lock_path(self) -> Path:
        return self.checked_root() / ".evict.lock"

    def close(self) -> None:
        self._root.close()


def os_error_reason(exc: OSError) -> Reason:
    """What a failed file operation counts as: a full disk or quota, or another error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Reason.BACKEND_FULL
    return Reason.BACKEND_ERROR
