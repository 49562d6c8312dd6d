"""Store keys of the graph store's artifacts, the rank bindings that share graph keys across ranks, and the key
records of what each FX key is made of (for ``recipecache explain``).

* Keys of artifacts holding compiled CPU code (graphs, AOTAutograd, ISA probes) carry the
  host-CPU fingerprint (:mod:`..host_cpu`): torch's own keys do not describe the CPU its
  ``-march=native`` kernels need; graph and AOTAutograd keys also carry the settings the
  compile reads that torch's keys do not hash (:func:`..torch_settings.outside_torch_keys`).
* A graph that uses this rank's process groups is stored under a rank-independent key
  (:mod:`..rank_binding`), learnt when torch computes its FX key
  (``codecache.compiled_fx_graph_hash``, :meth:`GraphKeys.describe_key`), which is also when
  what the key is made of and what the graph is (its function and input shapes, the ``meta``
  of the artifact it publishes) are kept until its lookup records them (:meth:`GraphKeys.record_key`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ...keylog import KeyLog
from ...reasons import Reason
from ...store import Store
from .. import describe, host_cpu, rank_binding
from ..artifact import torch_pickle
from ..metrics import Metrics
from ..torch_settings import outside_torch_keys
from .artifacts import KEY_PREFIX
from .attempt import Attempt
from .guard import Guard


class GraphKeys:
    """The store keys of one enabled store's artifacts, and the records of what its graph keys are made of."""

    def __init__(self, store: Store, metrics: Metrics, attempt: Attempt, guarded: Guard) -> None:
        self.metrics = metrics
        self.attempt = attempt
        self.guarded = guarded
        #: this host's CPU fingerprint, in the key of every artifact holding compiled CPU code
        #: (:mod:`..host_cpu`; ConfigError for a malformed override)
        self.cpu = host_cpu.fingerprint()
        #: the hook ``rank_binding`` is installed: graph keys naming this rank's groups are shared across ranks
        self.binds_ranks = False
        self.records = KeyLog.beside(store.events)
        self._lock = threading.Lock()
        #: torch's FX key -> the rank binding that shares it across ranks (:mod:`..rank_binding`), for the graphs
        #: that use this rank's process groups; torch's keys of these graphs name this rank's groups
        self._bindings: dict[str, rank_binding.Binding] = {}
        #: torch's FX keys of graphs that use this rank's groups and stay keyed per rank -> their identity
        #: across ranks (:attr:`..rank_binding.RankBound.identity`), for the key records
        self._rank_bound: dict[str, str | None] = {}

    def cpu_key(self, torch_key: str) -> str:
        """Store key of an artifact that holds or names compiled CPU code: it carries the host-CPU fingerprint."""
        return f"{KEY_PREFIX}cpu-{self.cpu}:{torch_key}"

    def compile_key(self, torch_key: str) -> str:
        """Store key of a graph or AOTAutograd entry torch names ``torch_key``: :meth:`cpu_key` with the settings
        the compile reads that torch's key does not hash (:func:`..torch_settings.outside_torch_keys`, e.g.
        ``torch.fx.experimental._config.backed_size_oblivious``), so a process never gets a graph compiled
        under another value of them."""
        return self.cpu_key(f"settings-{outside_torch_keys()}:{torch_key}")

    def graph_key(self, torch_key: str) -> tuple[str, rank_binding.Binding | None]:
        """Store key of the graph torch names ``torch_key`` (``pt2:fx-graph-v1::<FX key>:c1``), and its rank binding.

        A graph that uses this rank's process groups is stored under its rank-independent
        key (:func:`..rank_binding.bind`), so every rank with a group of the same role shares it.
        """
        with self._lock:
            bindings = list(self._bindings.items())
        for fx_key, binding in bindings:
            if fx_key in torch_key:
                return self.compile_key(torch_key.replace(fx_key, binding.key)), binding
        return self.compile_key(torch_key), None

    def describe_key(self, fx_key: str, details: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """torch computed an FX key (``compiled_fx_graph_hash(gm, example_inputs, fx_kwargs, ...)``): keep its
        components and what the graph is until its lookup."""
        gm = args[0] if args else kwargs["gm"]
        example_inputs = args[1] if len(args) > 1 else kwargs["example_inputs"]
        fx_kwargs = args[2] if len(args) > 2 else kwargs["fx_kwargs"]
        inputs_to_check = args[3] if len(args) > 3 else kwargs["inputs_to_check"]
        groups = self.guarded(rank_binding.process_groups)  # once: the key records and the binding both read them
        described = None if groups is None else self.guarded(rank_binding.describe_groups, gm, example_inputs, groups)
        if described:  # what of this rank's groups the key holds, for explain (torch's lines cut the code short)
            details = [*details, *described]
        self.attempt.described = (
            fx_key,
            details,
            describe.function_name(fx_kwargs),
            describe.input_shapes(example_inputs),
        )
        if self.binds_ranks and groups is not None and fx_key not in self._bindings and fx_key not in self._rank_bound:
            self.guarded(self._bind, fx_key, gm, example_inputs, fx_kwargs, inputs_to_check, groups)

    def _bind(
        self,
        fx_key: str,
        gm: Any,
        example_inputs: Any,
        fx_kwargs: Any,
        inputs_to_check: Any,
        groups: rank_binding.Groups,
    ) -> None:
        """Share the key of a graph that uses this rank's process groups across ranks, if it can be bound to
        every rank's own groups (:mod:`..rank_binding`); else it stays keyed per rank, counted."""
        try:
            binding = rank_binding.bind(gm, example_inputs, fx_kwargs, inputs_to_check, groups)
        except rank_binding.RankBound as exc:
            with self._lock:
                self._rank_bound[fx_key] = exc.identity
            self.metrics.fallback(
                Reason.RANK_BOUND,
                f"graph {fx_key[:10]} uses this rank's process groups and is "
                f"compiled by every rank that traces it, not once per job: {exc}",
            )
            return
        if binding is not None:
            with self._lock:
                self._bindings[fx_key] = binding

    def forget_binding(self, torch_key: str) -> None:
        """The graph ``torch_key`` names could not be stored under its shared key: it stays keyed per rank."""
        with self._lock:
            for fx_key in [k for k in self._bindings if k in torch_key]:
                self._rank_bound[fx_key] = self._bindings.pop(fx_key).key

    def adopt_bindings(self, bound: Iterable[tuple[str, str]]) -> None:
        """An AOTAutograd entry names graphs stored under keys shared across ranks (``(FX key, shared key)``): their
        FX keys, which this process did not compute (a hit skips the trace), are bound to those keys and to this
        rank's own process groups before torch looks the graphs up."""
        groups = rank_binding.process_groups()
        with self._lock:
            for fx_key, shared in bound:
                if fx_key not in self._rank_bound:
                    self._bindings.setdefault(fx_key, rank_binding.Binding(shared, {}, groups))

    def bindings_named(self, entry: bytes) -> list[tuple[str, str]] | None:
        """``(FX key, shared key)`` of the bound graphs the AOTAutograd ``entry`` names, or None if it names a graph
        keyed per rank (``rank_bound``): a hit would look it up under a key no rank shares."""
        if not (self._bindings or self._rank_bound):
            return []
        content = torch_pickle(entry)
        with self._lock:
            bindings = list(self._bindings.items())
            rank_bound = list(self._rank_bound)
        if any(fx_key.encode() in content for fx_key in rank_bound):
            return None
        return [(fx_key, binding.key) for fx_key, binding in bindings if fx_key.encode() in content]

    def record_key(self, torch_key: str) -> None:
        """The store is asked for ``torch_key``: record what it is made of (for ``recipecache explain``).

        torch's remote cache wraps the FX key (``pt2:fx-graph-v1::<key>:c1``), so the key
        the hash hook saw is matched by containment. It is recorded under the store key
        :meth:`.fx.GraphFlights.fx_candidates` made of ``torch_key`` (``attempt.key``, shared across ranks where bound).
        """
        described, self.attempt.described = self.attempt.described, None
        if described is None or described[0] not in torch_key:
            return
        fx_key, details, name, shapes = described
        attempt = self.attempt
        attempt.what = (name, shapes)
        if self.records.enabled and attempt.key is not None:  # parsing torch's hash details costs a few ms per lookup
            identity = attempt.binding.key if attempt.binding is not None else self._rank_bound.get(fx_key)
            self.records.record(
                attempt.key,
                details,
                name=name,
                shapes=shapes,
                identity=identity,
                context={**describe.process_context(), "cpu_key": self.cpu},
            )

    def close(self) -> None:
        """Close the key records."""
        self.records.close()
