"""The kernel libraries a graph loads, and the precompiled headers a hit does not need.

* ``codecache.write`` is wrapped to learn which ``<hash>.main.so`` kernels the current
  graph loads (they are not in torch's entry, so the put ships them beside it), and which
  kernel torch is loading; the C++ sources it writes go to the CPU-probe sharing (:mod:`.isa_probes`).
* ``codecache._precompile_header`` is skipped for a kernel whose ``.so`` is already
  there (a hit installed it): torch builds the precompiled header (a ``g++ -E`` of the
  ATen headers, then a 150 MB ``.gch`` in ``$TMPDIR``) before it looks for the kernel's
  library, so without this a hit on a fresh node would pay seconds for a header nothing
  compiles against. The kernel's key was computed before the header is attached, so
  the skip changes no key; a compile still gets torch's fast precompiled-header build.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch._functorch.config as functorch_config

from .attempt import Attempt
from .isa_probes import IsaProbes

log = logging.getLogger(__name__)

#: nice value of speculative background builds (a precompiled header a later compile may need): idle CPU only
BACKGROUND_NICE = 19

#: what torch writes between a kernel's source and its header build (the optional
#: optimized source, the header stub itself): still the same kernel
_SAME_KERNEL_WRITES = frozenset({"optimized.cpp", "h"})


class Kernels:
    """The kernels each thread's graph loads, and the background builds of the headers this process skipped."""

    def __init__(self, attempt: Attempt, probes: IsaProbes) -> None:
        self.attempt = attempt
        self.probes = probes
        #: this process has waited for another one's compile: a cold job, in which it may
        #: compile a later graph itself (see :meth:`warm_header`)
        self.followed = False
        self._lock = threading.Lock()
        #: precompiled headers being built (or built) in the background, by their arguments
        self._warm_headers: set[tuple[Any, ...]] = set()

    def record_write(self, extension: str, path: str) -> None:
        """torch wrote a file of ``extension`` at ``path``: a kernel's source names the library it loads."""
        attempt = self.attempt
        if extension == "main.cpp":
            attempt.loading_kernel = path[: -len("cpp")] + "so"
            attempt.kernels.add(attempt.loading_kernel)
            if attempt.build_kernels is not None:
                attempt.build_kernels.add(attempt.loading_kernel)
            return
        if extension not in _SAME_KERNEL_WRITES:
            attempt.loading_kernel = None
        if extension == "cpp":
            self.probes.record_source(path)

    @contextmanager
    def kernels_loaded(self) -> Iterator[set[str]]:
        """The kernel libraries this thread loads in the block, compiled or found: what a precompiled function
        built of inductor's graphs must carry, since torch's serialized graphs hold their source only."""
        attempt = self.attempt
        outer, attempt.build_kernels = attempt.build_kernels, set()
        try:
            yield attempt.build_kernels
        finally:
            if outer is not None:
                outer |= attempt.build_kernels
            attempt.build_kernels = outer

    def graph_cache_scope(self, gm: Any) -> AbstractContextManager[Any]:
        """Where inductor compiles one graph (``_compile_fx_inner``): inside a precompiled function's build, with
        torch's FX graph cache on, as on the normal path.

        ``aot_compile`` bundles inductor's graphs into AOTAutograd's entry and, to do so, turns
        the FX graph cache off (``bundled_autograd_cache``, which also enters the FX key). Its
        graphs would then reach the store only inside the precompiled artifact and an AOTAutograd
        entry under a key the normal path never computes: a fresh process that falls back (or
        runs without the tier) would compile every graph again. With the flag off for the
        graph's compile alone, the graph is looked up, single-flighted and published under the
        FX key the normal path computes, and AOTAutograd (outside this scope) still bundles the
        compiled graph it gets back. A graph without calls is left to torch's bundled path (off
        it, torch returns the module's own forward, which cannot be bundled).
        """
        from torch._dynamo.utils import count_calls

        if self.attempt.build_kernels is None or gm is None or count_calls(gm.graph) == 0:
            return nullcontext()
        return functorch_config.patch(bundled_autograd_cache=False)

    def kernel_is_built(self) -> bool:
        """Whether the library of the kernel torch is loading on this thread is already on disk."""
        library = self.attempt.loading_kernel
        return library is not None and Path(library).exists()

    def warm_header(self, build: Callable[[], object], arguments: tuple[Any, ...]) -> None:
        """Build a precompiled header this process skipped, in the background, if it is likely to need it.

        Only after this process waited for another one's compile (a cold job): it loaded
        that graph without the header, and if it compiles a later graph itself it would pay
        the header build (seconds of g++) on the job's critical path, while the rank that
        already has one waits for it. Built now, off the critical path, the later compile
        finds it (torch caches the result in-process; its build is file-locked, so a
        compile that asks meanwhile waits for this build instead of repeating it). A fresh
        process that only hits never waits, so it never builds one.

        The build runs at the lowest CPU priority (:data:`BACKGROUND_NICE`, this thread and
        the g++ it starts): it is speculative, and on a cold job every rank but the compiling
        one reaches it while that rank still compiles the job's next graph. Measured (issue
        27, 4 ranks on 2 cores, each in its own dirs): three followers' header builds at normal
        priority were most of the job's CPU beyond the one compile, beside that compile.
        """
        if not self.followed:
            return
        with self._lock:
            if arguments in self._warm_headers:
                return
            self._warm_headers.add(arguments)

        def run() -> None:
            _lower_this_threads_priority()
            try:
                build()
            except Exception:  # torch builds it itself when a compile needs it
                log.debug("recipecache: background header build failed", exc_info=True)

        threading.Thread(target=run, name="recipecache-header", daemon=True).start()


def _lower_this_threads_priority() -> None:
    """This thread, and the processes it starts, at :data:`BACKGROUND_NICE` (Linux, where a thread has its own
    nice value; elsewhere nothing changes: the call would name the whole process)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as exc:  # a container that forbids it: the build runs at the process's priority
        log.debug("recipecache: background build at normal priority: %s", exc)
