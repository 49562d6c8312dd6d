"""The vocabulary of outcomes: why a lookup missed, why a compile fell back, what role a process took.

Every counter, event and report in recipecache names its reasons with these members, and
every decision that depends on the *kind* of reason (may single-flight coordinate? was
the entry refused? did the service fail?) asks the groups below instead of keeping its
own list of strings. Members are strings, so they serialise to JSON and compare equal
to the plain names in older event logs and metrics files.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` of Python 3.11: members are their values as strings."""

        def __str__(self) -> str:
            return str(self.value)

        __format__ = str.__format__  # type: ignore[assignment]  # str's formatting, as enum.StrEnum's on 3.11


class Reason(StrEnum):
    """Why the store or an integration could not serve an artifact (or had to compile anyway)."""

    # -- the store answered: the entry is not there ------------------------------------
    NOT_FOUND = "not_found"
    # -- the store answered: an entry is there, and it was refused ----------------------
    #: damaged: framing, a header field, size or digest do not match, or it names another key or
    #: namespace (anyone can check, no secret needed; the store deletes it, comparing first)
    CORRUPT = "corrupt"
    #: not signed while a secret is configured (left in place: a job without a secret may use it)
    UNSIGNED = "unsigned"
    #: signed with another secret (left in place: the job that has that secret may use it)
    BAD_SIGNATURE = "bad_signature"
    #: written in an older envelope (or storage) format this version does not read (left in place
    #: for the older version that may still use it; the next put replaces it)
    OLD_FORMAT = "old_format"
    # -- the service itself failed --------------------------------------------------------
    BACKEND_DOWN = "backend_down"
    BACKEND_SLOW = "backend_slow"
    BACKEND_FULL = "backend_full"
    BACKEND_ERROR = "backend_error"
    # -- coordination -------------------------------------------------------------------
    #: waited for another process's compile past the deadline
    WAIT_TIMEOUT = "wait_timeout"
    #: a compare-and-set update (Store.update) lost to concurrent writers on every retry
    CONFLICT = "conflict"
    # -- the torch integration ----------------------------------------------------------
    #: a hook of ours raised; torch went on without it
    HOOK_ERROR = "hook_error"
    #: a verified entry that is not a well-formed artifact of the expected kind
    BAD_ARTIFACT = "bad_artifact"
    #: the artifact's kernel files could not be written locally
    INSTALL_FAILED = "install_failed"
    #: a kernel the graph loaded was gone when the artifact was published
    KERNEL_MISSING = "kernel_missing"
    #: this torch lacks a hook point the integration needs
    TORCH_INTERNALS = "torch_internals"
    #: the stored PGO state could not be merged with this rank's
    PGO_MERGE_FAILED = "pgo_merge_failed"
    #: a graph uses this rank's process groups in a way that cannot be bound to another rank's groups (two
    #: groups of the same role, a group name outside a collective, a stored graph this rank has no group for):
    #: keyed, compiled and stored per rank
    RANK_BOUND = "rank_bound"
    #: torch's guards rejected an entry the store served, so it compiled
    GUARD_REJECTED = "guard_rejected"
    #: the precompiled tier could not serve a call (graph break, guards, load error, other toolchain...):
    #: it ran on the normal path; the metrics name the detail (``precompile_fallbacks``)
    PRECOMPILE_FALLBACK = "precompile_fallback"
    #: no-stall: a graph's compile behind the steps failed, died, or its artifact could not be
    #: loaded; the graph stays without inductor in this process
    NO_STALL_FAILED = "no_stall_failed"
    #: no-stall: a graph no worker can compile under this process's key (it runs collectives on this process's
    #: groups; torch cannot serialize it; a global setting cannot travel): this process compiled it inline, on its
    #: step's path, and the others ran it without inductor until it was published
    NO_STALL_INLINE = "no_stall_inline"
    #: no-stall: a compile behind the steps ran past its deadline (``RECIPECACHE_NO_STALL_TIMEOUT``); its
    #: worker was ended and its lease released, and the graph stays without inductor in this process
    NO_STALL_TIMEOUT = "no_stall_timeout"
    #: no-stall: a compile behind the steps was still queued or running when the process exited, past the exit
    #: grace (``RECIPECACHE_EXIT_GRACE``): it was ended and its lease released, nothing was published, and the
    #: next process that meets the graph compiles it
    NO_STALL_UNFINISHED = "no_stall_unfinished"


class PrecompileDetail(StrEnum):
    """Why the precompiled tier sent a call to the normal path: the detail of one ``precompile_fallback``.

    The metrics count them under ``precompile_fallbacks``; a refused entry or a store that did
    not answer is named by its :class:`Reason` instead (``corrupt``, ``backend_down``...).
    """

    #: ``torch.compile`` asked for another backend than inductor (AOTInductor needs it)
    BACKEND = "backend"
    #: ``torch.compile`` options the tier cannot honour (``use_aoti``, ``guard_filter_fn``)
    OPTIONS = "options"
    #: a lazy module swaps its forward itself
    LAZY_MODULE = "lazy_module"
    #: ``torch.compile`` of a callable ``aot_compile`` cannot trace (a ``functools.partial``, a callable object)
    CALLABLE = "callable"
    #: the stored artifact was built from other code than this process runs (not loaded)
    SOURCE_CHANGED = "source_changed"
    #: verdict: dynamo cannot trace the function whole
    GRAPH_BREAK = "graph_break"
    #: the compiled callable already has its bound of per-signature lookups (``precompile.MAX_SHAPES``)
    TOO_MANY_SHAPES = "too_many_shapes"
    #: torch refuses to load an artifact built by another torch or Python
    INCOMPATIBLE = "incompatible"
    #: loading the artifact raised
    LOAD_FAILED = "load_failed"
    #: the artifact's guards reject these inputs
    GUARD_FAILED = "guard_failed"
    #: the precompile itself raised (not a verdict: another process may succeed)
    PRECOMPILE_FAILED = "precompile_failed"
    #: the inputs live on a device the tier was not checked on
    DEVICE_UNCHECKED = "device_unchecked"
    #: a value the traced code read besides its inputs (a default argument, closure cell, global, another
    #: module's or a class's attribute) differs from the one the artifact was traced with (it would bake the old one)
    VALUE_CHANGED = "value_changed"
    #: verdict: the traced code depends on a value the tier cannot compare across processes (an object torch
    #: guards by identity, or a guard it cannot follow), so no artifact is built for it
    UNCHECKED_VALUE = "unchecked_value"


class PrecompileShapes(StrEnum):
    """How the precompiled tier serves a graph's input sizes: the decision counted per loaded or built artifact."""

    #: a static graph (sizes in the key and the kernels), where torch's automatic dynamic compiles one:
    #: the first size a process meets, or ``dynamic=False``
    STATIC_PER_SHAPE = "static_per_shape"
    #: torch's dynamic graph (sizes are inputs): its guards decide which sizes it serves, so one artifact
    #: serves every later length (``dynamic=True``, or automatic dynamic once a dimension changed)
    DYNAMIC = "dynamic"


#: what the process that tried a precompile publishes for others to read instead of trying
VERDICTS = frozenset({PrecompileDetail.GRAPH_BREAK, PrecompileDetail.UNCHECKED_VALUE})


#: the entry is simply not there: a cold cache
ABSENT = frozenset({Reason.NOT_FOUND})
#: an entry is there but failed verification; nothing of it reaches a caller
REFUSED = frozenset({Reason.CORRUPT, Reason.UNSIGNED, Reason.BAD_SIGNATURE, Reason.OLD_FORMAT})
#: the backend did not answer usefully; single-flight cannot coordinate through it
FAILED = frozenset({Reason.BACKEND_DOWN, Reason.BACKEND_SLOW, Reason.BACKEND_FULL, Reason.BACKEND_ERROR})
#: the backend answered (absent or refused), so a lease can be taken for the compile
ANSWERED = ABSENT | REFUSED


class Role(StrEnum):
    """What one process did for one key that missed (see :mod:`recipecache.lease`)."""

    #: the store had it
    HIT = "hit"
    #: another process compiled it; we waited and loaded its artifact
    FOLLOWER = "follower"
    #: we hold the lease: we compile and publish
    LEADER = "leader"
    #: we waited past the deadline: we compile without a lease
    TIMEOUT = "timeout"
    #: the store could not coordinate (it failed): we compile locally
    FALLBACK = "fallback"
    #: another process holds the lease and we did not wait for it (``Store.begin(wait=False)``):
    #: no-stall ranks run the graph without inductor meanwhile
    BUSY = "busy"
