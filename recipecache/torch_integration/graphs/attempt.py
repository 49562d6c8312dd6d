"""One thread's graph attempt and the leases this process holds: what every part of the graph store shares.

A compile's parts reach the store from different hooks (the key's hash, the lookup, inductor's
codegen, the kernel writes, the put), all on the compiling thread, so what they learn of one
graph is kept per thread (:class:`Attempt`). The leases taken for it are also kept per process
(:class:`Leases`), so that disable() and interpreter exit free those of compiles still running.
``compile_fx._compile_fx_inner`` bounds one graph's compile (:mod:`..patches`): a lease whose put
never comes (the compile raised, the graph could not be pickled) is released when that compile
ends (:meth:`Leases.end_attempt`) rather than when its TTL runs out.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ...store import Flight

if TYPE_CHECKING:
    from .. import rank_binding


class Attempt(threading.local):
    """This thread's current FX graph, from torch's remote lookup to its put or the end of its compile."""

    def __init__(self) -> None:
        self.key: str | None = None
        #: the lease this thread holds for ``key`` (leader) or its lease-less local compile (fallback)
        self.flight: Flight | None = None
        #: the producer's compile seconds of the entry we served, until torch accepts it
        self.served_s: float | None = None
        #: the store counted this lookup a hit (``kind="fx"``) that is not yet known to be unused
        self.hit_counted = False
        self.compile_s = 0.0
        #: kernel libraries the graph loaded since the lookup (absolute paths)
        self.kernels: set[str] = set()
        #: the library of the kernel torch is loading on this thread (its source was the last
        #: one written): what a precompiled header would be built for
        self.loading_kernel: str | None = None
        #: every kernel library loaded on this thread while a precompiled function is built
        #: (:meth:`.kernels.Kernels.kernels_loaded`); outlives the graph attempts inside the build
        self.build_kernels: set[str] | None = None
        #: torch's FX key this thread computed last, its hash-detail lines, function name and
        #: input shapes; outlives end_attempt(), which runs between the key's computation
        #: and its lookup (:meth:`.keys.GraphKeys.record_key` takes it)
        self.described: tuple[str, list[str], str, str] | None = None
        #: the rank binding of the graph ``key`` names (:mod:`..rank_binding`), if its key is shared across ranks
        self.binding: rank_binding.Binding | None = None
        #: what ``key`` is (function name, input shapes), for the meta of its artifact
        self.what: tuple[str, str] = ("graph", "")
        #: overlap: this thread's compile may leave a graph another process compiles for its first call (set
        #: around torch's ``_compile_fx_inner``, not around the reload of such a graph; outlives end_attempt())
        self.deferrable = False
        #: overlap: the lease of the output strides of the forward this thread leads, published once lowered
        self.strides_flight: Flight | None = None
        #: overlap: the tracing context of the forward this thread last left for its first call, until AOTAutograd's
        #: backward stage of that compile asks (:meth:`.overlap.Overlap.backward_now`); outlives end_attempt()
        self.deferred_forward: Any = None


class Leases:
    """The flights of this process's graph attempts, by any thread: each released when its attempt ends, and all
    of them at disable or interpreter exit (:meth:`release_all`), so waiters need not wait for their TTL."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self._lock = threading.Lock()
        self._flights: dict[int, Flight] = {}

    def hold(self, flight: Flight) -> None:
        """This thread compiles the graph of ``flight`` (leader, or lease-less fallback); the put publishes."""
        self.attempt.flight = flight
        self.keep(flight)

    def keep(self, flight: Flight) -> None:
        """Keep ``flight`` until it is closed or forgotten."""
        with self._lock:
            self._flights[id(flight)] = flight

    def forget(self, flight: Flight) -> None:
        """``flight`` is ended elsewhere (published, or handed to a compile that outlives this attempt)."""
        with self._lock:
            self._flights.pop(id(flight), None)

    def close(self, flight: Flight) -> None:
        """Release ``flight``'s lease (if any) and forget it."""
        self.forget(flight)
        flight.release()

    def end_attempt(self) -> None:
        """The thread's graph compile is over (or a new one starts): free its lease, reset its record."""
        attempt = self.attempt
        if attempt.flight is not None:
            flight, attempt.flight = attempt.flight, None
            self.close(flight)
        if attempt.strides_flight is not None:
            flight, attempt.strides_flight = attempt.strides_flight, None
            self.close(flight)
        attempt.key = None
        attempt.binding = None
        attempt.what = ("graph", "")
        attempt.served_s = None
        attempt.hit_counted = False
        attempt.compile_s = 0.0
        attempt.kernels.clear()

    def release_all(self) -> None:
        """Free every lease any thread still holds (disable, interpreter exit)."""
        with self._lock:
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            flight.release()
