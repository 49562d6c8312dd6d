"""The torch side (2.13, 2.14, 2.15): the graph store's parts, wired up for one enabled store.

Line numbers and the reasons behind each hook are in docs/torch-integration-notes.md; the hooks
themselves (the patch table, and the backend classes torch builds) are :mod:`..patches`, which call
into the parts this module wires together, one module per job:

* :mod:`.fx`: the FX graph cache's remote tier, single-flighted per graph key, every stored
  guard variant offered to torch's own guard evaluation, each compile counted and timed.
* :mod:`.side_caches`: torch's other remote caches (AOTAutograd, PGO, Triton autotuning) through
  the store; :mod:`.artifacts` their lookups and puts, kernels installed on the way in.
* :mod:`.keys`: store keys (host-CPU fingerprint, settings outside torch's keys, rank bindings)
  and the key records of what each FX key is made of (for ``recipecache explain``).
* :mod:`.kernels`: the kernel libraries each graph loads (shipped with it) and the precompiled
  headers a hit skips; :mod:`.isa_probes` the CPU-feature probe libraries.
* :mod:`.overlap`: a graph whose lease another process holds is waited for at its first call,
  so this process compiles the next graph meanwhile.
* :mod:`.attempt`: what all of them share: each thread's graph attempt, the leases this process holds.

Every hook runs the original torch code first or around it and swallows its own
failures (counted as fallback ``hook_error``, :mod:`.guard`): the cache may fail, training may not.
Which hooks are installed is :mod:`..compat`'s call: those whose torch interface is there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...reasons import Role
from ...store import Store
from ..metrics import Metrics
from .artifacts import StoreArtifacts
from .attempt import Attempt, Leases
from .fx import GraphFlights
from .guard import Guard
from .isa_probes import IsaProbes
from .kernels import Kernels
from .keys import GraphKeys
from .overlap import Overlap
from .side_caches import SideCaches

if TYPE_CHECKING:
    from ..no_stall.controller import NoStall


class Integration:
    """One enabled store: the parts the hooks call into (torch builds backends with no arguments)."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        wait_timeout: float | None,
        *,
        no_stall: NoStall | None = None,
        wait_for_lease: bool = True,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        #: no-stall's background compiles (:mod:`..no_stall.controller`), when enabled: a graph that missed is deferred to them
        self.no_stall = no_stall
        #: False: a graph whose lease another process holds is not waited for (role ``busy``): no-stall
        #: ranks run it eagerly meanwhile (:attr:`no_stall`), a no-stall worker (``wait_for_lease=False``,
        #: no :attr:`no_stall` of its own) compiles it for that holder
        self.wait_for_lease = wait_for_lease and no_stall is None
        #: the hooks installed (:data:`..compat.HOOKS` whose interface this torch has)
        self.on: frozenset[str] = frozenset()
        self.guarded = Guard(metrics)
        self.attempt = Attempt()
        self.leases = Leases(self.attempt)
        self.artifacts = StoreArtifacts(store, metrics)
        self.keys = GraphKeys(store, metrics, self.attempt, self.guarded)
        #: the CPU-feature probe libraries, shared as artifacts of kind ``isa``
        self.probes = IsaProbes(
            store,
            metrics,
            wait_timeout,
            cpu_key=self.keys.cpu_key,
            fetch=self.artifacts.fetch,
            take=self.artifacts.take,
            put=self.artifacts.put,
            guarded=self.guarded,
        )
        self.kernels = Kernels(self.attempt, self.probes)
        self.overlap = Overlap(store, metrics, wait_timeout, self.leases)
        self.graphs = GraphFlights(
            store,
            metrics,
            wait_timeout,
            wait_for_lease=self.wait_for_lease,
            leases=self.leases,
            artifacts=self.artifacts,
            keys=self.keys,
            kernels=self.kernels,
            overlap=self.overlap,
            probes=self.probes,
            guarded=self.guarded,
        )
        self.side_caches = SideCaches(store, metrics, self.artifacts, self.keys)

    def defer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Exception | None:
        """torch is about to compile the graph this thread looked up and missed; the
        :class:`~..deferral.Deferred` to raise instead, or None to compile it here. No-stall:
        :meth:`..no_stall.controller.NoStall.intercept`; overlap: another process holds the lease
        (:meth:`.overlap.Overlap.defer_busy`).

        A no-stall leader's lease goes with its background compile (released when that ends), not with this attempt.
        A precompiled tier's build (``attempt.build_kernels`` set) is never deferred, as overlap leaves it:
        torch's ``aot_compile`` bundles the compiled graph itself into the artifact, and a stand-in fails its build
        (``precompile_failed`` on every function with ``--precompile --no-stall``, issue 43's corpus).
        """
        attempt = self.attempt
        flight = attempt.flight if attempt.key is not None else None
        if attempt.build_kernels is not None:
            return None
        if self.no_stall is not None:
            deferred = self.no_stall.intercept(flight, attempt.what, args, kwargs)
        elif flight is not None and flight.role is Role.BUSY:
            deferred = self.overlap.defer_busy(flight, args[0], args[1])
        else:
            return None
        if deferred is not None and flight is not None:
            self.leases.forget(flight)
            attempt.flight = None
        return deferred

    def close(self) -> None:
        """Free every lease and this thread's attempt, close the key log: the hooks are off (disable, a failed enable)."""
        self.leases.end_attempt()
        self.leases.release_all()
        self.keys.close()
