"""torch's remote caches beside the FX graph cache: AOTAutograd, PGO and Triton autotuning, through the store.

None of them is single-flighted: their entries are not compiles (an AOTAutograd entry names
the graphs it needs, which are; see docs/torch-integration-notes.md, "AOTAutograd entries are
not leased"), so each is a plain untraced lookup and put, but for PGO's state, which every rank
rewrites and is merged with a compare-and-set.
"""

from __future__ import annotations

from ...reasons import Reason
from ...store import Store
from ..artifact import Artifact
from ..metrics import Metrics
from . import pgo
from .artifacts import KEY_PREFIX, KIND_NAMES, StoreArtifacts
from .keys import GraphKeys


class SideCaches:
    """What torch's AOTAutograd, PGO and autotune backends get and put (``<kind>_get``, ``<kind>_put``)."""

    def __init__(self, store: Store, metrics: Metrics, artifacts: StoreArtifacts, keys: GraphKeys) -> None:
        self.store = store
        self.metrics = metrics
        self.artifacts = artifacts
        self.keys = keys
        #: the first traces this process records and replays (:class:`.pgo.Replay`)
        self.pgo_replay = pgo.Replay()

    def aot_get(self, torch_key: str) -> bytes | None:
        """No lease: see docs/torch-integration-notes.md ("AOTAutograd entries are not leased").

        An entry naming graphs stored under keys shared across ranks says so (:meth:`aot_put`): their FX keys
        are bound to those keys before torch looks the graphs up (:meth:`.keys.GraphKeys.adopt_bindings`)."""
        artifact = self.artifacts.fetch("aot", self.keys.compile_key(torch_key))
        if artifact is None:
            return None
        if artifact.bound:
            self.keys.adopt_bindings(artifact.bound)
        return artifact.entry

    def aot_put(self, torch_key: str, data: bytes) -> None:
        """An entry naming graphs that use this rank's process groups names them by this rank's FX keys: it
        carries the shared key each is stored under (:meth:`aot_get`). Not for an entry naming a graph keyed per
        rank (``rank_bound``): a hit would look it up under a key no rank shares, where tracing again finds it."""
        bound = self.keys.bindings_named(data)
        if bound is None:
            return
        self.artifacts.put("aot", self.keys.compile_key(torch_key), Artifact.single("aot", data, bound=bound).pack())

    def autotune_get(self, torch_key: str) -> bytes | None:
        """A Triton kernel's best config (JSON, never code); torch's key hashes the kernel's source, GPU included."""
        artifact = self.artifacts.fetch("autotune", KEY_PREFIX + torch_key)
        return None if artifact is None else artifact.entry

    def autotune_put(self, torch_key: str, data: bytes) -> None:
        self.artifacts.put("autotune", KEY_PREFIX + torch_key, Artifact.single("autotune", data).pack())

    def pgo_get(self, torch_key: str) -> bytes | None:
        """torch's state as torch wrote it; the first sizes stored beside it go to :attr:`pgo_replay`."""
        key = KEY_PREFIX + pgo.shared_key(torch_key)
        artifact = self.artifacts.fetch("pgo", key)
        if artifact is None:
            return None
        try:
            sizes, value = pgo.first_sizes(artifact.entry), pgo.torch_value(artifact.entry)
        except Exception as exc:  # noqa: BLE001 - torch's pickled entries may fail in any way
            self.metrics.fallback(Reason.HOOK_ERROR, f"{key}: first sizes unreadable: {exc!r}; not replayed")
            return artifact.entry  # torch reads its own field of it
        self.pgo_replay.learn(sizes)
        return value

    def pgo_put(self, torch_key: str, data: bytes) -> None:
        """Merge this rank's decisions into the shared state with a compare-and-set: concurrent ranks lose none.

        The first sizes this process recorded (:class:`.pgo.Replay`) travel in the same value."""
        key = KEY_PREFIX + pgo.shared_key(torch_key)
        data = pgo.with_first_sizes(data, self.pgo_replay.recorded_sizes())
        failures: list[Exception] = []

        def merged(current: memoryview | None) -> bytes | None:
            failures.clear()
            combined: bytes | None = data
            if current is not None:
                try:
                    stored = Artifact.unpack(current, "pgo").entry
                    combined = pgo.merge(data, stored)
                    if pgo.same_decisions(combined, stored):
                        combined = None  # the store has every decision of this rank already: write nothing
                except Exception as exc:  # noqa: BLE001 - torch's pickled state may fail in any way
                    failures.append(exc)  # replaced by this rank's state, which we can read
            return None if combined is None else Artifact.single("pgo", combined).pack()

        self.store.update(key, merged, meta={"kind": KIND_NAMES["pgo"]}, kind="pgo")  # counts a put only if it wrote
        if failures:
            self.metrics.fallback(Reason.PGO_MERGE_FAILED, f"{key}: {failures[0]!r}; published this rank's state")
        self.metrics.changed()
