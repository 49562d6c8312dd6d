"""One ``torch.compile``'d callable's calls: precompiled variants first, the store next, dynamo otherwise.

A :class:`Dispatcher` stands in for what ``torch.compile`` returned; it reads each call's
signature, keys it (:meth:`Dispatcher.key`: the module docstring of :mod:`.tier` says what the
key covers) and asks the tier once per new signature.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ...keys import make_key
from ...reasons import PrecompileDetail, Reason
from .compiled_function import guard_variant_key
from .keys import CompileSettings, call_key, devices_fingerprint, key_signature, module_state, signature, toolchain
from .variant import Fallback, Variant

if TYPE_CHECKING:
    from .tier import Tier

log = logging.getLogger(__name__)

#: what follows the integration's CPU-key prefix in the tier's store keys
KEY_KIND = "precompiled:"

#: signatures one compiled callable looks up in the store (train and eval are two per size). A
#: dynamic artifact answers the sizes after the first few without a lookup; a callable that meets
#: more distinct signatures anyway (say, one whose guards reject each other) runs the rest on the
#: normal path rather than asking the store on every new one
MAX_SHAPES = 16

#: device types the tier precompiles for: on CUDA (H200, torch 2.11) a cold ``aot_compile``
#: died of a segmentation fault, which no fallback can catch (docs/torch-integration-notes.md)
CHECKED_DEVICES = frozenset({"cpu"})


def unchecked_devices(target: Target, sig: tuple[Any, ...]) -> set[str]:
    """Device types of the inputs, parameters and buffers of a call that the tier was not checked on."""
    devices = {leaf[3].split(":")[0] for leaf in sig[1] if leaf[0] == "tensor"}
    owner = target.prefix[0] if target.prefix else None
    if isinstance(owner, torch.nn.Module):
        devices |= {t.device.type for t in itertools.chain(owner.parameters(), owner.buffers())}
    return devices - CHECKED_DEVICES


@dataclass
class Target:
    """What one precompiled function stands in for: the callable dynamo traces and how to call it."""

    #: what ``aot_compile_fullgraph`` traces: a module (its forward, or __call__ with hooks), a function, a method
    traced: Any
    settings: CompileSettings
    #: the traced function (whose defaults and closure cells a loaded artifact takes), its code (its identity
    #: in the key) and globals (where its bytecode runs)
    function: Any = None
    code: Any = None
    globals: dict[str, Any] = field(default_factory=dict)
    #: the bound ``self`` the precompiled function takes first, if any
    prefix: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        from torch._dynamo.convert_frame import get_traced_fn

        fn, bound = get_traced_fn(self.traced)
        self.function, self.code, self.globals = fn, fn.__code__, fn.__globals__
        self.prefix = () if bound is None else (bound,)

    @property
    def name(self) -> str:
        return getattr(self.code, "co_qualname", self.code.co_name)


class Dispatcher:
    """Stands in for one ``torch.compile``'d callable: precompiled variants first, dynamo otherwise.

    ``normal`` is what torch.compile returned (the dynamo path). Per call it reads the
    guard inputs it can read cheaply (:func:`call_key`, whose :func:`signature` it reads once
    per distinct key: the store key's form, several times slower); a signature seen before goes
    straight to its variant (whose guards are still checked) or to the normal path. A
    new one is resolved under a lock: a loaded variant whose guards accept it (a
    dynamic compile serves many sizes), else the store.

    The variants are tried as dynamo tries its cache entries, most recently used first: after a dynamic
    variant joined, a size the static one served before goes to the dynamic one, as under plain
    ``torch.compile`` (diffusers' UNet, sizes 16, 24, 16: the third step ran the static graph here and the
    dynamic one under torch, whose kernels round otherwise). So a signature whose variant is not the most
    recently used one is resolved again; in a steady state one variant serves every call and none is.
    """

    def __init__(
        self, tier: Tier, normal: Callable[..., Any], subject: Any, settings: CompileSettings, dynamo_ctx: Any
    ) -> None:
        self.tier = tier
        self.normal = normal
        self.subject = subject
        self.settings = settings
        self.dynamo_ctx = dynamo_ctx
        self._lock = threading.RLock()
        self._decided: dict[tuple[Any, ...], Variant | Fallback] = {}
        #: each call key's signature (:func:`call_key`: the signature is read once per call key, not per call)
        self._signatures: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        #: signatures read for calls (one per distinct call key)
        self.signatures_read = 0
        self._variants: list[Variant] = []
        #: the variants by store key
        self._loaded: dict[str, Variant] = {}
        #: store keys looked up (each a precompile on a cold store), at most MAX_SHAPES
        self._looked_up: set[str] = set()
        self._targets: dict[int, Target] = {}
        #: DDP's inner module and the forward routed through the tier that DDP calls
        self._inner_forward: tuple[Any, Callable[..., Any]] | None = None
        self._ddp = isinstance(subject, DistributedDataParallel)
        self.__wrapped__ = normal

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.tier.active or torch.compiler.is_compiling():
            return self.normal(*args, **kwargs)
        if self._ddp:
            return self._call_ddp(self.subject, args, kwargs)
        return self.run(self.subject, args, kwargs, self.normal)

    def run(self, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any], normal: Callable[..., Any]) -> Any:
        try:
            call = call_key(subject, args, kwargs)
            sig = self._signatures.get(call)
            if sig is None:
                sig = self._signatures[call] = signature(subject, args, kwargs)
                self.signatures_read += 1
            decided = self._decided.get(sig)
            if decided is None or (isinstance(decided, Variant) and decided is not self._variants[0]):
                decided = self._resolve(subject, sig, args, kwargs)
            elif isinstance(decided, Variant):
                refused = decided.refusal(args, kwargs)
                if refused is not None:
                    decided = self._reject(subject, sig, *refused, args, kwargs)
        except Exception as exc:  # a bug of ours must not stop training
            log.debug("recipecache: precompiled dispatch failed", exc_info=True)
            self.tier.metrics.fallback(Reason.HOOK_ERROR, f"precompiled dispatch: {exc!r}; torch goes on without it")
            decided = Fallback(Reason.HOOK_ERROR)
        if isinstance(decided, Variant):
            return decided(args, kwargs)
        return normal(*args, **kwargs)

    def _reject(
        self,
        subject: Any,
        sig: tuple[Any, ...],
        detail: PrecompileDetail,
        why: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Variant | Fallback:
        """A variant refused a signature it had served. Guards that reject it (an input the signature does not
        hold changed: a tensor inside an object, such as a KV cache that grows) send it to another variant or
        the store's next guard variant (:meth:`_resolve`); a traced value that changed sends it to the normal path."""
        with self._lock:
            if detail is PrecompileDetail.GUARD_FAILED:
                del self._decided[sig]
                return self._resolve(subject, sig, args, kwargs)
            decided = self._decided[sig] = self.tier.fallback(
                detail, f"a precompiled function no longer serves a call it served before: {why}"
            )
        return decided

    def _resolve(
        self, subject: Any, sig: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        """The variant (most recently used first) or the store's artifact serving ``sig``, or the normal path."""
        with self._lock:
            seen = self._decided.get(sig)
            decided = seen
            if decided is None or isinstance(decided, Variant):
                decided = next((v for v in self._variants if v.refusal(args, kwargs) is None), None)
                if decided is not None and seen is None:
                    self._share(subject, sig, decided, args, kwargs)
            if decided is None:
                decided = self._look_up(self.target(subject), sig, args, kwargs)
            if isinstance(decided, Variant):  # most recently used first, as dynamo moves its cache entry
                self._variants.remove(decided)
                self._variants.insert(0, decided)
            self._decided[sig] = decided
            return decided

    def _look_up(
        self, target: Target, sig: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        """The store's artifact for ``sig``, none of whose loaded variants serves it (a precompile where none is).

        One key can need several artifacts: guards check inputs the key does not hold (tensors inside
        an object, such as a KV cache whose length grows), and torch compiles a new graph wherever they
        reject. Where the artifacts loaded under the key reject this call, the next guard variant
        (:func:`.compiled_function.guard_variant_key`) is looked up, as torch recompiles, each lookup
        counted toward :data:`MAX_SHAPES`; a cold store gets them in the order calls meet them.
        """
        unchecked = unchecked_devices(target, sig)
        if unchecked:
            return self.tier.fallback(
                PrecompileDetail.DEVICE_UNCHECKED,
                f"{target.name} runs on {', '.join(sorted(unchecked))}, where the "
                "precompiled tier is not checked (a cold precompile on CUDA crashed its process)",
            )
        key = self.key(target, sig)
        n = -1
        while True:
            n += 1
            lookup = guard_variant_key(key, n)
            loaded = self._loaded.get(lookup)
            if loaded is not None:  # that very artifact is here, and it just said no
                detail, why = loaded.refusal(args, kwargs) or (PrecompileDetail.GUARD_FAILED, "")
                if detail is PrecompileDetail.GUARD_FAILED:
                    continue
                return self.tier.fallback(
                    detail, f"{target.name}'s precompiled artifact does not serve these inputs: {why}"
                )
            if lookup not in self._looked_up and len(self._looked_up) >= MAX_SHAPES:
                return self.tier.fallback(
                    PrecompileDetail.TOO_MANY_SHAPES,
                    f"{target.name} met more than {MAX_SHAPES} input signatures or guard variants "
                    "(bucket its inputs' lengths to precompile them all)",
                )
            self._looked_up.add(lookup)
            decided = self.tier.resolve(target, lookup, args, kwargs)
            if not isinstance(decided, Variant):
                return decided
            self._variants.insert(0, decided)
            self._loaded[lookup] = decided
            self.tier.metrics.precompile_shapes(decided.shapes)
            if decided.refusal(args, kwargs) is None:
                return decided

    def _share(
        self, subject: Any, sig: tuple[Any, ...], variant: Variant, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A loaded variant serves the new signature ``sig``: make its key find that variant too (:meth:`.build.Builder.share`)."""
        target = self.target(subject)
        key = self.key(target, sig)
        if key not in self._loaded:
            self.tier.builder.share(target, key, variant, args, kwargs)

    def target(self, subject: Any) -> Target:
        target = self._targets.get(id(subject))
        if target is None:
            if subject is not self.subject and isinstance(subject, torch.nn.Module):
                traced = type(subject).forward.__get__(subject)  # DDP's inner module: its own forward, not ours
            elif getattr(subject, "__func__", None) is torch.nn.Module._call_impl:
                traced = subject.__self__  # Module.compile(): the module itself
            else:
                traced = subject
            target = self._targets[id(subject)] = Target(traced, self.settings)
        return target

    def key(self, target: Target, sig: tuple[Any, ...]) -> str:
        """The store key of ``target`` called with signature ``sig`` (see the module docstring)."""
        code = target.code
        owner = target.prefix[0] if target.prefix else None
        identity = [
            getattr(target.traced, "__module__", None),
            code.co_filename,
            target.name,
            code.co_firstlineno,
            type(owner).__module__ + "." + type(owner).__qualname__ if owner is not None else None,
        ]
        state = module_state(owner) if isinstance(owner, torch.nn.Module) else []
        devices = {leaf[3] for leaf in sig[1] if leaf[0] == "tensor"}
        fingerprint = {**toolchain(), **self.settings.fingerprint(), "devices": devices_fingerprint(devices)}
        shapes = [repr(key_signature(sig, self.settings.dynamic is True)), repr(state)]
        return self.tier.cpu_key(KEY_KIND + make_key(repr(identity), shapes, fingerprint=fingerprint))

    def _call_ddp(self, ddp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """DDP's forward eagerly, its inner module's forward through the tier (dynamo also compiles only that)."""
        inner = ddp.module
        if self._inner_forward is None or self._inner_forward[0] is not inner:
            self._inner_forward = (inner, self._routed_forward(inner))
        forward = self._inner_forward[1]
        inner.forward = forward
        try:
            return ddp(*args, **kwargs)
        finally:
            del inner.forward

    def _routed_forward(self, inner: Any) -> Callable[..., Any]:
        """What DDP calls as ``inner``'s forward: the tier (made once per inner module, not per call)."""
        inner_normal = self.dynamo_ctx(type(inner).forward.__get__(inner))

        def forward(*a: Any, **k: Any) -> Any:
            del inner.forward  # tracing, guards and the artifact must see the module as the user built it
            try:
                return self.run(inner, a, k, inner_normal)
            finally:
                inner.forward = forward

        return forward
