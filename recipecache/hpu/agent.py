"""The per-node sync agent: node recipe directory <-> shared store.

One agent per node, next to the training ranks. Each cycle it

1. reads the index (:mod:`recipecache.hpu.index`);
2. publishes every recipe the bridge finished on this node that the index does not
   list for this node's fingerprint (complete = unlocked, non-empty metadata; see
   :mod:`recipecache.hpu.recipes`), each under its own store key;
3. merges its publications into the index until it has read them back (that heals the
   lost updates of an unlocked read-merge-write);
4. installs, oldest first, every recipe the index lists for this fingerprint that the
   directory lacks, evicting the oldest recipes first so the directory stays under its
   cap; recipes listed for other fingerprints are counted and never fetched.

Each recipe is handled once per agent: published, installed, found already present,
refused, or missing from the store. The bridge evicts too, and re-installing what it
evicted would only churn the directory. Store failures never stop the agent (the store
degrades; what failed is retried next cycle), and neither does anything else one cycle
raises: it is logged and counted (``cycle_errors``) and the next cycle runs. If the sync
thread itself dies, the agent exits with status 1, so a stopped sync is never silent.

Run: ``RECIPECACHE_URL=URL python -m recipecache.hpu.agent --dir D --namespace NS [--interval S] [--once]``
(``--url`` exists for people typing a URL without a password: any user of the machine can
read a process's arguments with ``ps``, while its environment is private to its owner).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import env as envvars
from .. import quantities
from ..argparsing import OneLineArgumentParser
from ..errors import ConfigError
from ..reasons import Reason
from ..store import Store, open_store
from .index import INDEX_CAP, INDEX_KEY, Index, IndexEntry, fingerprint_id, recipe_key
from .recipe_cache_config import (
    DEFAULT_MAX_SIZE_MB,
    ENV_VAR,
    MIB,
    node_directory,
    parse_config,
    prepare_node_directory,
)
from .recipes import Install, RecipeDir, RecipeFiles

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
UNKNOWN = "unknown"
#: Kernel ABI: the habanalabs driver's version, per device (new accel class, then the old one).
_DRIVER_VERSION_FILES = ("/sys/class/accel/accel*/device/driver_ver", "/sys/class/habanalabs/hl*/driver_ver")


def _bridge_version() -> str:
    try:
        return importlib.metadata.version("habana-torch-plugin")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def _driver_version() -> str:
    for pattern in _DRIVER_VERSION_FILES:
        for path in sorted(glob.glob(pattern)):
            try:
                return Path(path).read_text().strip() or UNKNOWN
            except OSError:
                continue
    return UNKNOWN


def hpu_fingerprint(bridge_version: str | None = None, driver_version: str | None = None) -> dict[str, str]:
    """What a recipe depends on beyond its graph: the bridge (``habana-torch-plugin``) and driver versions.

    Arguments win; otherwise the installed bridge package and the driver's sysfs
    version are read (without importing torch). Nodes that differ in either never
    exchange recipes.
    """
    return {"hpu_bridge": bridge_version or _bridge_version(), "hpu_driver": driver_version or _driver_version()}


class HpuSyncAgent:
    """Keeps one node's recipe directory and the shared store in sync; see the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        store: Store,
        *,
        fingerprint: Mapping[str, str],
        max_size_mb: int = DEFAULT_MAX_SIZE_MB,
        interval: float = DEFAULT_INTERVAL_S,
        clear: bool = False,
    ) -> None:
        self.dir = RecipeDir(prepare_node_directory(directory), max_size_mb * MIB)
        self.store = store
        self.fingerprint = dict(fingerprint)
        self.fingerprint_id = fingerprint_id(self.fingerprint)
        self.interval = interval
        if UNKNOWN in self.fingerprint.values():
            log.warning(
                "recipecache: HPU fingerprint %s is incomplete; recipes are exchanged only with nodes "
                "that cannot tell either (pass the versions explicitly)",
                self.fingerprint,
            )
        #: recipes dealt with for good (see the module docstring)
        self._done: set[str] = set()
        #: what this agent published, kept to re-add to the index until it is read back
        self._published: dict[str, IndexEntry] = {}
        self._confirmed: set[str] = set()
        self._foreign_seen: set[tuple[str, str]] = set()
        self._counts: Counter[str] = Counter()
        self.dir.remove_temps()
        if clear:
            log.info("recipecache: cleared %d recipes from %s", self.dir.clear(), self.dir.path)

    def _record(self, event: str, name: str, duration: float = 0.0, **extra: Any) -> None:
        self.store.events.record(event, name, duration, fingerprint=self.fingerprint_id, **extra)

    # -- one cycle -----------------------------------------------------------------
    def sync_once(self) -> None:
        """One pass: read the index, publish, repair the index, skip foreign recipes, install."""
        found = self.store.lookup(INDEX_KEY, node=False)  # rewritten by every node's agent: never a node copy
        if found.refused:  # forged or damaged; agents rebuild it below
            self._counts["refused"] += 1
            self._record("hpu_refuse", INDEX_KEY, reason=found.reason)
        index = Index.decode(found.data) if found.data is not None else Index.empty()
        self._publish_local(index)
        self._update_index(index)
        self._count_foreign(index)
        self._install_listed(index)

    def _publish_local(self, index: Index) -> None:
        for local in sorted(self.dir.scan().values(), key=lambda r: r.created):
            if local.name in self._done or not local.has_meta:
                continue
            if (self.fingerprint_id, local.name) in index:
                self._done.add(local.name)  # another node published it first; ours is the same recipe
                continue
            files = self.dir.read_complete(local.name)
            if files is None:
                continue  # still being written: next cycle
            start = time.perf_counter()
            if self.store.put(
                recipe_key(local.name, self.fingerprint), files.pack(), meta={"kind": "hpu_recipe", "name": local.name}
            ):
                self._published[local.name] = IndexEntry(self.fingerprint_id, local.name, time.time(), files.size)
                self._settle(local.name, "published", "hpu_publish", time.perf_counter() - start, bytes=files.size)

    def _update_index(self, index: Index) -> None:
        self._confirmed.update(name for name in self._published if (self.fingerprint_id, name) in index)
        # An entry read back once and gone later was either trimmed by the cap (leave it)
        # or lost with the whole index or to a racing writer (put it back while there is room).
        missing = [
            e
            for name, e in self._published.items()
            if (self.fingerprint_id, name) not in index and (name not in self._confirmed or len(index) < INDEX_CAP)
        ]
        if missing:
            self.store.put(
                INDEX_KEY,
                index.merged(missing, self.fingerprint_id, self.fingerprint).encode(),
                meta={"kind": "hpu_index"},
                node=False,
            )  # rewritten by every node's agent

    def _count_foreign(self, index: Index) -> None:
        for key, entry in index.entries.items():
            if entry.fingerprint != self.fingerprint_id and key not in self._foreign_seen:
                self._foreign_seen.add(key)
                self._counts["skipped_incompatible"] += 1
                self._record(
                    "hpu_skip", entry.name, reason="incompatible", built_with=index.fingerprints.get(entry.fingerprint)
                )

    def _install_listed(self, index: Index) -> None:
        local = self.dir.scan()
        wanted = sorted(
            (e for e in index.entries.values() if e.fingerprint == self.fingerprint_id and e.name not in self._done),
            key=lambda e: e.published,
        )
        for entry in wanted:
            if entry.name in local and local[entry.name].has_meta:
                self._done.add(entry.name)  # the bridge here wrote it too
                continue
            if not self._install(entry):
                return  # the store or the directory is busy or down: the rest waits for the next cycle

    def _install(self, entry: IndexEntry) -> bool:
        """Fetch and install one listed recipe; False when the next cycle should retry it and the rest."""
        start = time.perf_counter()
        found = self.store.lookup(recipe_key(entry.name, self.fingerprint))
        if found.failed:
            return False  # the backend failed; the store has logged it
        if found.absent:
            self._settle(entry.name, "missing", "hpu_skip", reason=found.reason)  # evicted from the store
            return True
        files = RecipeFiles.unpack(found.data, entry.name) if found.data is not None else None
        if files is None:
            reason = found.reason or Reason.BAD_ARTIFACT
            log.warning("recipecache: refused HPU recipe %s from the store (%s)", entry.name, reason)
            self._settle(entry.name, "refused", "hpu_refuse", reason=reason)
            return True
        if files.size > self.dir.max_bytes:
            self._settle(entry.name, "too_large", "hpu_skip", reason="too_large", bytes=files.size)
            return True
        fits, evicted = self.dir.make_room(files.size)
        for name in evicted:
            self._counts["evicted"] += 1
            self._record("hpu_evict", name)
        if not fits:
            return False  # every older recipe is locked by a rank right now
        outcome = self.dir.install(files)
        if outcome is Install.INSTALLED:
            self._settle(entry.name, "installed", "hpu_install", time.perf_counter() - start, bytes=files.size)
        elif outcome is Install.PRESENT:
            self._done.add(entry.name)
        return True  # BUSY: a rank is writing it here now; look again next cycle

    def _settle(self, name: str, counter: str, event: str, duration: float = 0.0, **extra: Any) -> None:
        """Count and record the final outcome for recipe ``name``; it is not looked at again."""
        self._done.add(name)
        self._counts[counter] += 1
        self._record(event, name, duration, **extra)

    # -- running -------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Sync every ``interval`` seconds until ``stop`` is set, then once more.

        The last pass publishes what the bridge finished just before the job ended. A
        directory error (a rank clearing it, a full disk) costs one cycle, not the agent;
        so does any other exception, which is a bug or damage we did not foresee: logged
        with its traceback and counted, and the sync goes on.
        """
        while True:
            last = stop.is_set()
            try:
                self.sync_once()
            except Exception as exc:  # one bad cycle must not stop the node's sync
                self._counts["cycle_errors"] += 1
                log.warning(
                    "recipecache: HPU sync of %s failed (%s); retrying next cycle",
                    self.dir.path,
                    exc,
                    exc_info=not isinstance(exc, OSError),
                )
            if last:
                return
            stop.wait(self.interval)

    def stats(self) -> dict[str, Any]:
        counts = (
            "published",
            "installed",
            "skipped_incompatible",
            "refused",
            "missing",
            "evicted",
            "too_large",
            "cycle_errors",
        )
        return {
            **{name: self._counts[name] for name in counts},
            "directory": str(self.dir.path),
            "fingerprint": self.fingerprint,
            "fingerprint_id": self.fingerprint_id,
        }


def start_agent(
    *,
    directory: str | os.PathLike[str],
    url: str | None = None,
    namespace: str | None = None,
    max_size_mb: int = DEFAULT_MAX_SIZE_MB,
    interval: float = DEFAULT_INTERVAL_S,
    clear: bool = False,
    bridge_version: str | None = None,
    driver_version: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the node's agent as a child process that ends when this process (or what it execs) ends.

    A process, not a thread, so a launcher that ``exec``s torchrun keeps it: the agent
    watches its parent pid and stops (after a last publish) once it is reparented.
    Stop it earlier with ``terminate()``. ``env`` is its environment (default: ours);
    ``url`` reaches it as ``RECIPECACHE_URL`` there, never as an argument: any user of the
    machine can read a process's arguments (``ps``), and the URL may hold a password.
    """
    argv = [
        sys.executable,
        "-m",
        "recipecache.hpu.agent",
        "--dir",
        str(directory),
        "--max-size-mb",
        str(max_size_mb),
        "--interval",
        str(interval),
        "--parent-pid",
        str(os.getpid()),
    ]
    for flag, value in (
        ("--namespace", namespace),
        ("--bridge-version", bridge_version),
        ("--driver-version", driver_version),
    ):
        if value is not None:
            argv += [flag, value]
    if clear:
        argv.append("--clear")
    environ = dict(os.environ if env is None else env)
    if url is not None:
        environ[envvars.URL] = url
    return subprocess.Popen(argv, env=environ)


# -- command line ------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m recipecache.hpu.agent",
        description="Sync a node's Gaudi recipe directory with a recipecache store.",
    )
    p.add_argument(
        "--dir", help=f"node recipe directory (default: the path in ${ENV_VAR}, else a private temp directory)"
    )
    p.add_argument(
        "--max-size-mb",
        type=quantities.argument_type("--max-size-mb"),
        help=f"directory cap in MB (default: from ${ENV_VAR}, else {DEFAULT_MAX_SIZE_MB})",
    )
    p.add_argument(
        "--url",
        help="store URL (default: $RECIPECACHE_URL or the filesystem default); a password in "
        "it is visible to every user of the machine (ps), so pass such a URL in "
        "$RECIPECACHE_URL instead",
    )
    p.add_argument("--namespace", help="namespace (default: $RECIPECACHE_NAMESPACE or 'default')")
    p.add_argument(
        "--interval",
        type=quantities.argument_type("--interval", fraction=True),
        default=DEFAULT_INTERVAL_S,
        help="seconds between passes",
    )
    p.add_argument("--once", action="store_true", help="one pass, then exit")
    p.add_argument("--clear", action="store_true", help="empty the directory before the first pass")
    p.add_argument("--bridge-version", help="Gaudi PyTorch bridge version (default: installed habana-torch-plugin)")
    p.add_argument("--driver-version", help="habanalabs driver version (default: from sysfs)")
    p.add_argument(
        "--parent-pid",
        type=quantities.argument_type("--parent-pid"),
        help="stop when this process is no longer the parent",
    )
    p.add_argument("--json", action="store_true", help="print the final stats as JSON")
    return p


def _directory_and_cap(args: argparse.Namespace, namespace: str) -> tuple[Path, int]:
    """--dir/--max-size-mb, else what the bridge is told in $PT_HPU_RECIPE_CACHE_CONFIG, else defaults."""
    env_config = parse_config(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) and args.dir is None else None
    directory = node_directory(namespace, args.dir if env_config is None else env_config.path)
    if args.max_size_mb is not None:
        max_size_mb = args.max_size_mb
    else:
        max_size_mb = env_config.max_size_mb if env_config else DEFAULT_MAX_SIZE_MB
    if max_size_mb <= 0:
        raise ConfigError(f"--max-size-mb must be positive, got {max_size_mb}")
    return directory, max_size_mb


def _stop_with_parent(parent_pid: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    stop = threading.Event()
    if args.once:
        stop.set()
    for signum in (signal.SIGTERM, signal.SIGINT):  # first, so that a stop during start-up still ends cleanly
        signal.signal(signum, lambda *_: stop.set())
    try:
        if args.interval <= 0:
            raise ConfigError(f"--interval must be positive, got {args.interval}")
        store = open_store(args.url, namespace=args.namespace)
        directory, max_size_mb = _directory_and_cap(args, store.namespace)
        agent = HpuSyncAgent(
            directory,
            store,
            fingerprint=hpu_fingerprint(args.bridge_version, args.driver_version),
            max_size_mb=max_size_mb,
            interval=args.interval,
            clear=args.clear,
        )
    except ConfigError as exc:
        print(f"recipecache-hpu-agent: error: {exc}", file=sys.stderr)
        return 2
    if args.parent_pid is not None:
        threading.Thread(target=_stop_with_parent, args=(args.parent_pid, stop), daemon=True).start()
    # The loop runs in a thread: the signal handler runs on the main thread, and calling
    # stop.set() there while that same thread is inside stop.wait() can deadlock on the
    # event's internal lock.
    died: list[BaseException] = []

    def work() -> None:
        try:
            agent.run(stop)
        except BaseException as exc:  # whatever ends the thread early ends the agent, loudly
            died.append(exc)
            log.critical("recipecache: HPU sync thread died; the agent stops", exc_info=True)

    worker = threading.Thread(target=work, name="recipecache-hpu-agent")
    worker.start()
    worker.join()
    stats = {"agent": agent.stats(), "store": store.stats()}
    store.close()
    a = stats["agent"]
    print(
        json.dumps(stats, sort_keys=True)
        if args.json
        else f"recipecache hpu agent {a['directory']}: published {a['published']}, installed {a['installed']}, "
        f"refused {a['refused']}, skipped {a['skipped_incompatible']} incompatible"
    )
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
