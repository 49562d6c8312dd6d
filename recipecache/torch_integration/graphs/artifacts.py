"""Artifacts read from and written to the store, their kernels installed on the way in.

Every kind goes through here: the graph single-flight (:mod:`.fx`) unpacks and installs the
variants its flight was served, while AOTAutograd, PGO and autotune entries (:mod:`.side_caches`)
and the CPU probes (:mod:`.isa_probes`) are plain untraced lookups and puts: they are not compiles,
so they stay out of the event log the simulator replays as the job's compile keys.
"""

from __future__ import annotations

from pathlib import Path

from torch._inductor.runtime.runtime_utils import cache_dir

from ...errors import ConfigError
from ...reasons import Reason
from ...store import Flight, Store
from ..artifact import Artifact, ArtifactError, Entry, install
from ..metrics import Metrics

#: prefix of every store key written here; bumping it retires all artifacts of an older format
KEY_PREFIX = "torch3:"
#: what ``recipecache ls`` calls each artifact kind (the ``kind`` of its envelope meta)
KIND_NAMES = {
    "fx": "graph",
    "aot": "aot",
    "pgo": "pgo",
    "isa": "cpu_probe",
    "autotune": "autotune",
    "strides": "output_strides",
}


class StoreArtifacts:
    """Lookups and puts of artifacts on one store, counted in its metrics."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics

    def fetch(self, kind: str, key: str) -> Artifact | None:
        """The (non-graph) artifact under ``key`` with its kernels installed, or None (counted by reason).

        PGO state is rewritten in place (:meth:`Store.update`), so it is never read from a node copy.
        """
        found = self.store.lookup(key, trace=False, node=kind != "pgo", kind=kind)
        if found.failed:
            assert found.reason is not None  # a failed lookup names its failure
            self.metrics.fallback(found.reason, f"store {self.store.url} did not answer; compiling locally")
        return self.take(kind, key, found.data)

    def take(self, kind: str, key: str, data: memoryview | None) -> Artifact | None:
        """The artifact in ``data`` (what the store had under ``key``, an untraced lookup of ``kind``) with its
        kernels installed, or None; a hit it cannot use is counted as a miss."""
        if data is None:  # the store counted the miss
            self.metrics.changed()
            return None
        artifact = self.unpack(key, data, kind)
        if artifact is None or not self.install(key, artifact, artifact.entries[0]):
            self.store.record_unused_hit(
                key, Reason.BAD_ARTIFACT if artifact is None else Reason.INSTALL_FAILED, kind=kind, trace=False
            )
            self.metrics.changed()
            return None
        self.metrics.saved(artifact.entries[0].compile_s)
        return artifact

    def unpack(self, key: str, data: memoryview, kind: str) -> Artifact | None:
        """The artifact of ``kind`` in ``data``, or None (counted ``bad_artifact``) if it is not one."""
        try:
            return Artifact.unpack(data, kind)
        except ArtifactError as exc:
            self.metrics.fallback(Reason.BAD_ARTIFACT, f"{key}: {exc}; compiling locally")
            return None

    def install(self, key: str, artifact: Artifact, entry: Entry) -> bool:
        """Install the kernels ``entry`` loads into torch's cache dir; False (counted ``install_failed``) if refused or failed."""
        try:
            installed = install(artifact.files_of(entry), Path(cache_dir()))
        except (OSError, ConfigError) as exc:
            self.metrics.fallback(Reason.INSTALL_FAILED, f"{key}: {exc}; not installing its kernels, compiling locally")
            return False
        if installed:
            self.metrics.kernels(installed=installed)
        return True

    def put(self, kind: str, key: str, blob: bytes, flight: Flight | None = None) -> None:
        """Publish an AOTAutograd or probe artifact (written once per key, so a plain put, or through the
        untraced ``flight`` that leads it); kept out of the trace."""
        meta = {"kind": KIND_NAMES[kind]}
        if flight is not None:
            flight.publish(blob, meta=meta)  # counted under the flight's kind
        else:
            self.store.put(key, blob, trace=False, meta=meta, kind=kind)
        self.metrics.changed()
