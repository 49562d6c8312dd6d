"""Sharing the CPU-feature probe libraries torch builds before its first CPU compile.

torch probes each vector ISA the CPU claims with a g++ build of a test file (seconds
each, ~10 builds on an AVX-512 machine), in every fresh process. These libraries are
artifacts like any other: a process installs the set another one built (``isa_key``),
and the ranks of a cold job single-flight each probe as they build it, starting at
their own share of the list. This module knows only the probes; how artifacts are
fetched, published and keyed is handed in (``fetch``/``take``/``put`` of :class:`~.artifacts.StoreArtifacts`,
``cpu_key`` of :class:`~.keys.GraphKeys`), so it imports neither.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch._inductor import cpu_vec_isa
from torch._inductor.cpu_vec_isa import VecISA
from torch._inductor.runtime.runtime_utils import cache_dir

from ...env import process_rank, process_world_size
from ...store import Flight, Store
from ..artifact import PROBE_LOADED, Artifact, collect
from ..metrics import Metrics

log = logging.getLogger(__name__)


class _Probing(threading.local):
    """The probe running on this thread: torch writes its source on this thread, and we learn its library."""

    def __init__(self) -> None:
        self.in_probe = False
        #: the library of the CPU probe running on this thread
        self.library: str | None = None


class IsaProbes:
    """This process's view of the probe libraries: installed yet, built here, being shared."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        wait_timeout: float | None,
        *,
        cpu_key: Callable[[str], str],
        fetch: Callable[[str, str], Artifact | None],
        take: Callable[[str, str, memoryview | None], Artifact | None],
        put: Callable[[str, str, bytes, Flight | None], None],
        guarded: Callable[..., Any],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        self._cpu_key, self._fetch, self._take, self._put, self._guarded = cpu_key, fetch, take, put, guarded
        self._thread = _Probing()
        self._lock = threading.Lock()
        self._isa_files: set[str] = set()
        #: the probe libraries of this host kind are here (installed, or published by us)
        self._isa_done = False
        self._isa_fingerprint: str | None = None
        self._isa_probing_ordered = False
        #: :meth:`probe_while_waiting` started its thread
        self._probing_while_waiting = False

    def record_source(self, path: str) -> None:
        """torch wrote the C++ source ``path``: if a probe is running on this thread, it is that probe's."""
        probing = self._thread
        if probing.in_probe:
            probing.library = path[: -len("cpp")] + "so"
            with self._lock:
                self._isa_files.add(probing.library)

    def isa_fingerprint(self) -> str:
        """What torch names this host kind's probe libraries by: torch version, machine, compiler."""
        if self._isa_fingerprint is None:
            from torch._inductor.cpp_builder import (
                get_compiler_version_info,
                get_cpp_compiler,
            )

            text = f"{torch.__version__}|{platform.machine()}|{get_compiler_version_info(get_cpp_compiler())}"
            self._isa_fingerprint = hashlib.sha256(text.encode()).hexdigest()
        return self._isa_fingerprint

    def isa_key(self) -> str:
        """Key of this host kind's complete set of probe libraries (what a fresh process installs).

        torch names them by compiler, ISA flags and version; which ones a host builds
        depends on its CPU, so the key carries the host-CPU fingerprint too.
        """
        return self._cpu_key(f"isa-probe:{self.isa_fingerprint()}")

    def probe_key(self, isa: VecISA, code: str) -> str:
        """Key of one probe's library, shared while the ranks of a cold job probe the CPU together.

        Under the host-CPU fingerprint (computed once per process) like the
        complete set: only ranks on the same kind of CPU share a probe's answer.
        """
        text = f"{self.isa_fingerprint()}|{isa.build_arch_flags()}|{code}"
        return self._cpu_key(f"isa-probe1:{hashlib.sha256(text.encode()).hexdigest()}")

    def install_isa_probe(self) -> None:
        """Before torch probes the CPU, install the libraries another process built.

        Tried in enable() and again before each probe until it succeeds: on a cold job a
        rank that waited for another's first graph probes only when it loads that graph,
        by which time the compiling rank has published its probe libraries.
        """
        if self._isa_done:
            return
        if self._fetch("isa", self.isa_key()) is not None:
            self._isa_done = True

    def probe_cpu_in_rank_order(self) -> None:
        """On a cold start, probe the CPU's vector ISAs starting at a rank-dependent one.

        torch probes every ISA the CPU claims (a g++ build of a test file per ISA and
        feature, seconds each, ~10 builds on an AVX-512 machine) in one fixed order, the
        first time a process compiles. Ranks that compile at the same moment on a cold job
        would all build the same probes in the same order; starting each rank at its share
        of the list, and sharing each probe as it is built (:meth:`probe`), they meet in the
        middle and each builds about its share. Called when torch asks for the valid ISAs,
        before its first probe, so no probe is running; the answers are torch's own (each
        ISA caches its answer), only the order differs.
        """
        with self._lock:
            if self._isa_probing_ordered:
                return
            self._isa_probing_ordered = True
        world = process_world_size()
        if world < 2 or platform.machine() not in ("x86_64", "AMD64"):
            return
        self.install_isa_probe()
        if self._isa_done:
            return
        # the ISAs valid_vec_isa_list() probes on x86 (cpu_vec_isa.py): those whose flags the CPU claims
        claimed = cpu_vec_isa.x86_isa_checker()
        isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in claimed for f in str(isa).split())]
        if not isas:
            return
        start = process_rank() * len(isas) // world % len(isas)
        for isa in isas[start:] + isas[:start]:
            bool(isa)

    def probe_while_waiting(self, another_compiles: Callable[[], bool]) -> None:
        """This process is about to wait for a graph ``another_compiles``: probe the CPU meanwhile, in the background.

        On a cold job one rank compiles the first graph and the others wait for it. The
        compiling rank then probes the CPU alone, on the job's critical path (a g++ build per
        vector ISA: 24-31 s of a 76 s first compile, measured on a 2-core machine), while the
        ranks that wait do nothing. Probing now, in rank order and single-flighted per probe
        (:meth:`probe_cpu_in_rank_order`, :meth:`probe`), they build their share of the
        probes beside it, and their own later compiles or loads find torch's answers cached.
        Only while this host's probes are neither installed nor started, in a job of several
        processes: a fresh job installs them at enable() and never starts this.
        """
        if (
            self._isa_done
            or self._isa_probing_ordered
            or self._probing_while_waiting
            or process_world_size() < 2
            or not another_compiles()
        ):
            return
        with self._lock:
            if self._probing_while_waiting:
                return
            self._probing_while_waiting = True
        # the ISA list as torch asks for it (our hook probes in rank order first); torch caches the answers
        threading.Thread(
            target=self._guarded, args=(cpu_vec_isa.valid_vec_isa_list,), name="recipecache-probes", daemon=True
        ).start()

    def probe(self, check_build: Callable[[VecISA, str], bool], isa: VecISA, code: str) -> bool:
        """torch's probe build of ``code`` for ``isa``, built by one process of the job and installed by the others.

        In a job of several processes, until this host kind's complete set is here, each
        probe is single-flighted on its own key (:meth:`probe_flight`): ranks that ask for
        the same probe at once (all of them, on a CPU with one vector ISA) build it once;
        the others wait, install its library, and torch's check finds it built.
        """
        probing = self._thread
        shared = not self._isa_done and process_world_size() > 1
        key = self._guarded(self.probe_key, isa, code) if shared else None
        flight = None if key is None else self._guarded(self.probe_flight, key)
        probing.in_probe, probing.library = True, None
        try:
            return check_build(isa, code)
        finally:
            probing.in_probe = False
            if flight is not None:
                built: list[str] = [] if probing.library is None else [probing.library]
                self._guarded(self.publish_probe, flight.key, built, flight)
                flight.release()  # published (which released it) or not: its waiters go on

    def probe_load(self, probe_load: Callable[[VecISA, str], bool], isa: VecISA, output_path: str) -> bool:
        """torch's dlopen test of a probe library, skipped where its "loaded" marker lies beside the library.

        The test is a Python subprocess per ISA (~0.15 s each, ~1 s of a fresh process's first
        call). torch >= 2.14 leaves ``<library>.load_ok`` once it passed and skips it then; 2.13
        runs it in every process, the first load of a precompiled function included. This is
        2.14's rule on every release: a marker comes from this node's earlier test, or with the
        library from the store, under the host-CPU fingerprint's key (:meth:`publish_probe`).
        """
        marker = Path(output_path + PROBE_LOADED)
        if marker.is_file():
            return True
        loaded = probe_load(isa, output_path)
        if loaded:
            try:
                marker.write_bytes(b"")  # as torch 2.14 does: an empty file beside the library
            except OSError as exc:  # the next process tests again; nothing else depends on it
                log.debug("recipecache: no probe marker %s: %s", marker, exc)
        return loaded

    def probe_flight(self, key: str) -> Flight | None:
        """The flight under which this process builds the probe of ``key``, or None: another process built it
        (installed now, counted as a hit) or its artifact is unusable (counted; torch builds it here)."""
        flight = self.store.begin(key, wait_timeout=self.wait_timeout, trace=False, kind="isa")
        if flight.reason is not None:
            self.metrics.fallback(
                flight.reason, f"{key}: {flight.reason}; probing the CPU without other ranks", counted_by_store=True
            )
        if flight.data is None:
            self.metrics.changed()  # a miss, which the store counted
            return flight
        self._take("isa", key, flight.data)
        return None

    def publish_probe(self, key: str, libraries: Iterable[str], flight: Flight | None = None) -> None:
        """Publish the probe libraries among ``libraries`` that were built (an ISA the compiler lacks has none).

        Through ``flight`` even when none was built: its waiters then take that answer and
        probe at once, all together, rather than one after the other as each takes the lease.
        With each library goes the marker that its dlopen probe loaded it, where one was
        written (torch >= 2.14, or :meth:`probe_load`): a library without it is probed again (a
        Python subprocess per ISA, ~0.15 s each) by every fresh process, which a warm local
        cache never pays.
        """
        files, _missing = collect([f for lib in libraries for f in (lib, lib + PROBE_LOADED)], Path(cache_dir()))
        if files or flight is not None:
            self._put("isa", key, Artifact.single("isa", b"", files).pack(), flight)
            self.metrics.kernels(shipped=len(files))

    def publish_isa_probe(self) -> None:
        with self._lock:
            if self._isa_done or not self._isa_files:
                return
            self._isa_done = True
            paths = set(self._isa_files)
        self.publish_probe(self.isa_key(), paths)
