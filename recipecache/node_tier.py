"""The node tier: a directory on a node's local disk in front of a remote store.

Without it every rank reads every artifact from the remote store, so a node of 8 ranks
makes 8 reads of the same bytes, and a job of 1,000 such nodes pulls every artifact
8,000 times through one server at job start. Processes that use the same node directory
are one node: a lookup looks in the directory first; on a miss exactly one process of
the node fetches the entry from the remote store and publishes it in the directory, where
the node's other processes read it. That is single-flight (:mod:`recipecache.lease`) over
the directory's own lease primitive: the fetcher renews its lease while it reads, and
if it dies mid-fetch its lease expires and another process of the node takes the fetch
over. A fetcher that finds nothing to publish (the remote store has no entry, or failed)
releases its lease and each waiting process asks the remote store itself: that answer
is cheap, and asking it one process after another would queue them behind the lease.
Remote reads per artifact per job are then at most the number of nodes.

This module knows files and coordination, never envelopes: the store hands it
``verify`` (the very checks it applies to the remote store's entries: checksum, key,
signature) and the verified entry it read remotely, so only verified entries are copied
in. An entry in the directory that fails ``verify`` is a miss, fetched again; a damaged
one (a torn write, a bad disk, tampering) is deleted, unless it changed since it was read
(compare-and-delete, as the store deletes), and one merely refused (signed with another
secret, unsigned, an older format) is left alone: the directory is shared by the user's
jobs, and the job it belongs to may be using it. The directory is a
filesystem backend with a size cap (least recently used entries are evicted first), so
the same layout, atomic publishing and directory checks as the filesystem store.

A failing directory (full, unwritable) never fails a lookup: the store reads the remote
store directly, and the failure is logged once and counted (``node_errors``).

The directory is shared by every job of the user on the node, whatever store each uses, so
a copy is filed under the identity of the store it came from (``Backend.identity``: its
location without credentials) as well as its key: a job on store B is never served what
only store A holds, and the operator tools on store B (``ls``, ``verify``, ``clear``) see
B's copies (:meth:`NodeTier.copies`) and no others.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from .backends.base import EntryInfo
from .backends.filesystem import FilesystemBackend
from .buffers import Buffer
from .errors import BackendError, VerificationError
from .lease import SingleFlight, new_token
from .reasons import Reason, Role
from .stats import Stats

log = logging.getLogger(__name__)

#: a verified payload, and the store's answer to a lookup
P = TypeVar("P")
A = TypeVar("A")

#: A waiting process looks at the directory this often at first, doubling up to the max:
#: a local stat, so waits end within milliseconds of the fetcher's publish.
POLL_INITIAL_S = 0.005
POLL_MAX_S = 0.05
#: hex digits of the store's identity digest a copy's key ends with (128 bits: no two stores share one)
STORE_TAG_HEX = 32


def default_node_dir() -> Path:
    """Where ``recipecache-run`` puts a node's directory: ``$TMPDIR/recipecache-node-<uid>``.

    Local disk, shared by every job of this user on the node (entries are namespaced and
    verified, so a later job starts warm); the uid keeps other users of ``/tmp`` out.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"recipecache-node-{uid}"


class NodeTier:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        store: str,
        max_size: int,
        lease_ttl: float,
        wait_timeout: float,
        stats: Stats,
    ) -> None:
        """``store`` is the identity of the store in front of which this tier sits (``Backend.identity``)."""
        self._tag = hashlib.sha256(store.encode()).hexdigest()[:STORE_TAG_HEX]
        self.backend = FilesystemBackend(directory, max_size=max_size, what="node directory")
        self.directory = self.backend.root
        self._flight = SingleFlight(
            self.backend,
            ttl=lease_ttl,
            poll_initial=POLL_INITIAL_S,
            poll_max=POLL_MAX_S,
            activity=None,
            takeover_on_release=False,
        )
        self._wait_timeout = wait_timeout
        self._stats = stats
        self._warned = False

    def read(
        self,
        name: str,
        verify: Callable[[Buffer], P],
        remote: Callable[[], tuple[A, Buffer | None]],
        hit: Callable[[P], A],
    ) -> A:
        """The answer for backend key ``name``: from the directory, else from ``remote`` through one process per node.

        ``remote`` returns the store's answer and the verified entry to copy in (None when
        there is none); ``hit`` turns a payload read here into the store's answer.
        """
        name = self.copy_key(name)
        try:
            local = self._local(name, verify)
            if local is not None:
                self._stats.count("node_hits")
                return hit(local)
            outcome = self._flight.run(name, lambda: self._local(name, verify), self._wait_timeout)
        except BackendError as exc:
            self._failed(exc)
            return self._fetch(name, remote)
        if outcome.role is Role.FOLLOWER:
            assert outcome.value is not None
            self._stats.count("node_hits")
            if outcome.waited_s:
                self._stats.count("node_waits")
            return hit(outcome.value)
        if outcome.role is Role.LEADER:
            assert outcome.lease is not None
            if outcome.takeover:
                self._stats.count("node_takeovers")
            try:
                return self._fetch(name, remote)
            finally:
                outcome.lease.release()
        # the fetcher released its lease without publishing (nothing there), or we waited past the deadline
        return self._fetch(name, remote)

    def publish(self, name: str, entry: Buffer, *more: Buffer) -> None:
        """Copy a verified entry (the concatenation of ``entry`` and ``more``) into the directory
        (also what this process itself put)."""
        self._publish(self.copy_key(name), entry, *more)

    def _publish(self, copy: str, entry: Buffer, *more: Buffer) -> None:
        try:
            self.backend.put(copy, entry, *more)
        except BackendError as exc:
            self._failed(exc)

    @contextlib.contextmanager
    def rewriting(self, name: str) -> Iterator[None]:
        """Hold the node's fetch lease on ``name`` while this process rewrites the entry and publishes it here.

        The node's readers then wait for the copy this process leaves instead of fetching
        the value being replaced. Best effort: a fetch already under way, or a failing
        directory, does not hold up the write.
        """
        token, name = new_token(), self.copy_key(name)
        try:
            held = self.backend.lease_add(name, token, self._flight.ttl)
        except BackendError as exc:
            self._failed(exc)
            held = False
        try:
            yield
        finally:
            if held:
                try:
                    self.backend.lease_release(name, token)
                except BackendError as exc:
                    self._failed(exc)

    def copy_key(self, name: str) -> str:
        """The directory's key of the copy of the store's entry ``name``: the entry's key with the store's tag after it
        (the directory's fan-out stays the entry's own)."""
        return name + self._tag

    def copies(self, namespace: str | None) -> Iterator[EntryInfo]:
        """This store's copies in the directory (of ``namespace``, or of all), each under the store's key of it."""
        for info in self.backend.scan(namespace):
            if info.key.endswith(self._tag):
                yield EntryInfo(info.key.removesuffix(self._tag), info.size, info.atime)

    def close(self) -> None:
        self.backend.close()

    def _fetch(self, copy: str, remote: Callable[[], tuple[A, Buffer | None]]) -> A:
        self._stats.count("node_fetches")
        answer, entry = remote()
        if entry is not None:
            self._stats.count("node_fetched_bytes", memoryview(entry).nbytes)
            self._publish(copy, entry)
        return answer

    def _local(self, name: str, verify: Callable[[Buffer], P]) -> P | None:
        entry = self.backend.get(name)
        if entry is None:
            return None
        try:
            return verify(entry)
        except VerificationError as exc:
            if exc.reason is not Reason.CORRUPT:
                # refused, not damaged (another secret, an older format): the node directory is shared
                # by this user's jobs, and the job this copy belongs to may still use it
                log.info("recipecache: node directory entry %s refused (%s); reading the store", name, exc)
                return None
            log.warning("recipecache: node directory entry %s is damaged (%s); fetching it again", name, exc)
            if self.backend.delete_if(name, entry):  # unless a good copy was published meanwhile
                self._stats.count("node_deleted_bad")
            return None

    def _failed(self, exc: BackendError) -> None:
        self._stats.count("node_errors")
        if not self._warned:
            self._warned = True
            log.warning(
                "recipecache: node directory %s failed (%s: %s); reading the remote store directly",
                self.directory,
                exc.reason,
                exc,
            )
