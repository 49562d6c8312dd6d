"""FX graphs through the store, single-flighted: one process per graph key compiles, the others wait for its artifact.

Graphs are where single-flight happens: torch splits a compile into lookup (miss) ... ``put``,
so a miss opens a :class:`~recipecache.store.Flight` and the put merges the new graph into the
key's entry and ends the flight. A graph key holds all its dynamic-shape guard variants
(bounded), and torch's remote lookup reads only one entry per key, so
``FxGraphCache.iterate_over_candidates`` is wrapped (:mod:`..patches`): after torch's local
candidates it offers every stored variant to torch's own guard evaluation
(:meth:`GraphFlights.fx_candidates`). ``compile_fx.fx_codegen_and_compile`` is wrapped to count
and time the graphs inductor actually compiles here (:meth:`GraphFlights.compiled`).

The put does not end its flight through :meth:`Flight.publish`, a plain put: the key's entry is
merged with a compare-and-set (:meth:`Store.update`), since other processes add their variants
to it, and the put happens whether or not this thread holds the key's flight (a put under the
rank's own key after the shared one was refused, a compile whose lease went with a deferral);
the flight, if any, is then released.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

from torch._inductor.runtime.runtime_utils import cache_dir

from ...reasons import Reason, Role
from ...store import Store
from .. import describe, rank_binding
from ..artifact import Artifact, ArtifactError, Entry, collect, torch_pickle
from ..metrics import Metrics
from .artifacts import StoreArtifacts
from .attempt import Attempt, Leases
from .guard import Guard
from .isa_probes import IsaProbes
from .kernels import Kernels
from .keys import GraphKeys
from .overlap import Overlap, strides_wanted

log = logging.getLogger(__name__)

#: how many times one graph lookup waits for another process's new guard variant before
#: compiling its own without a lease (each wait needs the key to have changed meanwhile)
VARIANT_WAITS = 4


class GraphFlights:
    """The FX graph cache's remote tier: each thread's lookup (its flight) and put of one graph."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        wait_timeout: float | None,
        *,
        wait_for_lease: bool,
        leases: Leases,
        artifacts: StoreArtifacts,
        keys: GraphKeys,
        kernels: Kernels,
        overlap: Overlap,
        probes: IsaProbes,
        guarded: Guard,
    ) -> None:
        #: graph artifacts (FX) are single-flighted and traced in the event log (the simulator
        #: replays it as the job's compile keys)
        self.store = store
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        #: False: a graph whose lease another process holds is not waited for (role ``busy``)
        self.wait_for_lease = wait_for_lease
        self.leases = leases
        self.attempt: Attempt = leases.attempt
        self.artifacts = artifacts
        self.keys = keys
        self.kernels = kernels
        self.overlap = overlap
        self.probes = probes
        self.guarded = guarded
        #: the store key of the graph this process looked up last (the no-stall worker reports it)
        self.last_key: str | None = None

    def fx_candidates(self, torch_key: str) -> Iterator[tuple[Any, bytes, bool]]:
        """The stored guard variants of one graph, one at a time, for torch's own guard evaluation.

        Stands in for the remote part of ``FxGraphCache.iterate_over_candidates`` (torch
        evaluates each candidate's guards and stops at the first that accepts its inputs),
        yielding what torch's remote branch yields: ``(graph, pickled graph, False)``. A
        variant's kernels are installed just before it is offered. Torch accepting one
        closes this generator at its ``yield``: a hit. Exhausting it is a miss: when torch
        rejected every stored variant, :meth:`Store.begin` with ``stale`` makes this
        process the compiler of the key's next variant, or has it wait for the process
        already compiling one and offers that one too. A leader's lease is held in
        :attr:`attempt` until :meth:`fx_put` merges the new variant in.
        """
        self.leases.end_attempt()
        key, binding = self.keys.graph_key(torch_key)
        attempt = self.attempt
        attempt.key = self.last_key = key
        attempt.binding = binding
        self.guarded(self.keys.record_key, torch_key)
        try:
            yield from self._offer_variants(key)
        except GeneratorExit:  # torch's guards accepted the variant it was evaluating: the store counted the hit
            self.metrics.saved(attempt.served_s or 0.0)
            raise
        except Exception as exc:  # our failure: torch compiles as on a miss
            log.debug("recipecache: offering variants of %s failed", key, exc_info=True)
            self.metrics.fallback(Reason.HOOK_ERROR, f"fx_candidates: {exc!r}; torch goes on without it")
            self._unused_hit(key, Reason.HOOK_ERROR)
        self.metrics.changed()  # a miss, which the store counted

    def _unused_hit(self, key: str, reason: Reason | None, *, trace: bool = True) -> None:
        """The graph lookup of this thread's attempt will not use what it was served: if the store counted a hit,
        it becomes a miss for ``reason`` (once per lookup; ``trace=False`` where ``begin(stale=...)`` traced it)."""
        attempt = self.attempt
        if attempt.hit_counted and reason is not None:
            attempt.hit_counted = False
            self.store.record_unused_hit(key, reason, kind="fx", trace=trace)

    def _offer_variants(self, key: str) -> Iterator[tuple[Any, bytes, bool]]:
        attempt = self.attempt
        offered: set[bytes] = set()
        install_failed = False
        if self.wait_for_lease:  # a cold job's waiting ranks probe the CPU beside the rank that compiles
            self.guarded(self.probes.probe_while_waiting, lambda: self.store.compiling(key))
        overlap = self.overlap.enabled and attempt.deferrable and attempt.build_kernels is None
        flight = self.store.begin(
            key, wait_timeout=self.wait_timeout, kind="fx", wait=self.wait_for_lease and not overlap
        )
        attempt.hit_counted = flight.data is not None
        if overlap and flight.role is Role.LEADER:
            self.store.events.record("compile_start", key)  # the store records it only for a lookup that may wait
            if strides_wanted():
                self.overlap.lead_strides(key)
        for waits in itertools.count():
            if flight.waited_s:
                self.kernels.followed = True
                self.metrics.changed()
            if flight.data is None:  # we compile it (leader, or unleased after a failure or timeout)
                # after begin(stale=...): the first lookup's hit was not used (the stale begin traced the miss)
                self._unused_hit(key, flight.miss_reason, trace=False)
                self.leases.hold(flight)
                return
            artifact = self.artifacts.unpack(key, flight.data, "fx")
            for entry in artifact.entries if artifact is not None else ():
                if entry.data in offered:
                    continue
                offered.add(entry.data)
                if not self.artifacts.install(key, artifact, entry):  # type: ignore[arg-type]  # entries only when there is an artifact
                    install_failed = True
                    continue
                try:
                    content = torch_pickle(entry.data)
                    graph = pickle.loads(content)  # noqa: S301 - verified bytes, unpickled as torch's own remote branch does
                except Exception:  # torch skips an entry it cannot load, and so do we
                    log.warning("recipecache: cannot load a stored variant of %s; skipping it", key, exc_info=True)
                    continue
                if attempt.binding is not None:
                    try:  # the stored code names placeholders: this rank's own groups take their place
                        content = rank_binding.rebind_graph(graph, attempt.binding.groups)
                    except rank_binding.RankBound as exc:
                        self.metrics.fallback(Reason.RANK_BOUND, f"{key}: {exc}; compiling locally")
                        install_failed = True  # compile it here, unleased, as for a variant we cannot use
                        continue
                attempt.served_s = entry.compile_s
                yield graph, content, False
                attempt.served_s = None  # resumed: its guards rejected these inputs
            reason = Reason.BAD_ARTIFACT if artifact is None else Reason.GUARD_REJECTED
            if install_failed or waits == VARIANT_WAITS:
                # a variant we could not install may be the one we need: compile it here, unleased
                # (its put replaces the stored twin with the same guards), or stop waiting
                self._unused_hit(key, reason)
                return
            flight = self.store.begin(
                key,
                wait_timeout=self.wait_timeout,
                stale=flight.data,
                stale_reason=reason,
                kind="fx",
                wait=self.wait_for_lease,
            )

    def fx_put(self, torch_key: str, data: bytes) -> None:
        """Merge the graph torch compiled here into its key's variants (compare-and-set), then free the lease."""
        key, binding = self.keys.graph_key(torch_key)
        if binding is not None:
            try:  # stored with placeholders: the bytes name no real group
                data = binding.canonical_graph(data)
            except rank_binding.RankBound as exc:
                self.metrics.fallback(Reason.RANK_BOUND, f"{key}: {exc}; published under this rank's own key")
                self.keys.forget_binding(torch_key)
                key = self.keys.compile_key(torch_key)
        attempt = self.attempt
        files, missing = collect(attempt.kernels, Path(cache_dir()))
        if missing:
            self.metrics.fallback(
                Reason.KERNEL_MISSING,
                f"{len(missing)} kernel(s) of {key} not built when it was saved; "
                "publishing it without them (a hit compiles those)",
            )
        ours = attempt.key == key
        compile_s = attempt.compile_s if ours else 0.0
        variant = Entry(data, compile_s, tuple(f.path for f in files), _guards_of(data))
        meta = describe.graph_meta(*(attempt.what if ours else ("graph", "")), compile_s)

        def merged(current: memoryview | None) -> bytes:
            base = Artifact("fx", ())
            if current is not None:
                with suppress(ArtifactError):  # unreadable: replaced, the new variant is the only one we can vouch for
                    base = Artifact.unpack(current, "fx")
            return base.with_variant(variant, files).pack()

        # node=True: a node copy missing this variant is safe, since begin(stale=...) reads past it
        self.store.update(key, merged, trace=True, meta=meta, node=True, kind="fx")
        if ours and attempt.flight is not None:
            flight, attempt.flight = attempt.flight, None
            self.leases.close(flight)
        self.metrics.kernels(shipped=len(files))
        self.probes.publish_isa_probe()

    def compiled(self, seconds: float) -> None:
        """inductor codegen of one graph ran here for ``seconds``."""
        attempt = self.attempt
        attempt.compile_s += seconds
        if attempt.served_s is not None and attempt.key is not None:  # torch's guards rejected the entry we served
            self._unused_hit(attempt.key, Reason.GUARD_REJECTED)
            self.metrics.saved(-attempt.served_s)
            attempt.served_s = None
        self.store.record_compile(attempt.key, seconds)
        self.metrics.changed()


def _guards_of(entry: bytes) -> str | None:
    """torch's guard expression of an FX entry this process just produced ("" for none), None if unreadable.

    Our own process's bytes, unpickled as torch unpickles them on a hit, to tell a
    recompile of a stored variant (same guards) from a new variant.
    """
    try:
        graph = pickle.loads(torch_pickle(entry))  # noqa: S301 - this process's own bytes (above)
        guards = graph.guards_expr
    except Exception:  # not knowing only costs a slot among the variants
        log.debug("recipecache: cannot read the guards of a graph being published", exc_info=True)
        return None
    return "" if guards is None else guards if isinstance(guards, str) else None
