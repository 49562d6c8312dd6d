"""The vocabulary of ``recipecache doctor``: one check's outcome, and the checks every directory gets.

Backends report their own checks (:meth:`recipecache.backends.base.Backend.health_checks`)
with :class:`HealthCheck`; :mod:`recipecache.tools.doctor` adds the checks that need no
backend. Each check is one line for people: what was checked, what was found, and for a
check that did not pass, how to fix it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .fsutil import private_directory
from .sizes import format_size

PASS, WARN, FAIL = "pass", "warn", "fail"
#: free space below which a directory of artifacts fails the check (one large graph's kernels)
MIN_FREE_BYTES = 256 * 1024**2
#: free space below which it passes with a warning
LOW_FREE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class HealthCheck:
    """One line of ``recipecache doctor``.

    ``status`` is :data:`PASS`, :data:`WARN` (works, but read the detail) or :data:`FAIL`;
    ``fix`` says what to do about anything but a pass.
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (where ``path`` would be created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(name: str, path: Path) -> HealthCheck:
    """Free space of the file system holding ``path`` (or its nearest existing parent)."""
    probe = _nearest_existing(path)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return HealthCheck(name, FAIL, f"{path}: cannot read free space ({exc.strerror})", "check the mount")
    detail = f"{path}: {format_size(free)} free"
    if free < MIN_FREE_BYTES:
        return HealthCheck(
            name, FAIL, detail, f"free space, or point it elsewhere (needs at least {format_size(MIN_FREE_BYTES)})"
        )
    if free < LOW_FREE_BYTES:
        return HealthCheck(name, WARN, detail, "artifacts of a large model can take gigabytes; free some space")
    return HealthCheck(name, PASS, detail)


def private(name: str, path: Path, what: str) -> HealthCheck:
    """Whether ``path`` is a directory only we can change (created if missing), as artifact directories must be."""
    try:
        directory = private_directory(path, what)
    except ConfigError as exc:
        return HealthCheck(name, FAIL, str(exc), f"use a directory only you can write, e.g. chmod 700 {path}")
    st = os.stat(directory)
    return HealthCheck(name, PASS, f"{directory}: private to uid {st.st_uid} (mode {st.st_mode & 0o777:o})")


def writable(name: str, path: Path) -> HealthCheck:
    """Whether this process can create files in ``path`` (or create ``path`` in its nearest existing parent)."""
    probe = _nearest_existing(path)
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
        return HealthCheck(
            name, PASS, f"{path}: writable" + ("" if probe == path else f" (will be created in {probe})")
        )
    return HealthCheck(
        name, FAIL, f"{path}: not writable by this user", f"fix the permissions of {probe} or point it elsewhere"
    )
