"""What a precompiled function's store key is made of, apart from the store and the tier.

The tier (:mod:`.tier`) keys each artifact by the traced function, its guard
inputs and what the compiled code depends on: the ``torch.compile`` settings and torch's
config (:class:`CompileSettings`), the toolchain, the call's signature (:func:`signature`,
:func:`key_signature`, :func:`module_state`), and after tracing the code dynamo inlined
(:func:`traced_code`, whose digests :mod:`.code_digest` takes). Kept apart so that another
tier (precompiled functions for varying shapes) builds the same keys from the same parts.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...reasons import PrecompileDetail
from ..torch_settings import config_modules, keyed, keyed_overrides, settings, stable_repr
from .compiled_function import FORMAT

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class CompileSettings:
    """What ``torch.compile`` was asked for (the parts that shape the compiled code)."""

    backend: Any
    mode: str | None
    options: dict[str, Any] | None
    dynamic: bool | None

    @classmethod
    def from_call(cls, kwargs: dict[str, Any]) -> CompileSettings:
        options = kwargs.get("options")
        return cls(
            kwargs.get("backend", "inductor"),
            kwargs.get("mode"),
            dict(options) if isinstance(options, dict) else None,
            kwargs.get("dynamic"),
        )

    def unsupported(self) -> PrecompileDetail | None:
        """Why these settings cannot be precompiled (the tier builds with torch's inductor backend), or None."""
        if self.backend != "inductor":
            return PrecompileDetail.BACKEND
        if self.options and ("use_aoti" in self.options or "guard_filter_fn" in self.options):
            return PrecompileDetail.OPTIONS
        return None

    def fingerprint(self) -> dict[str, str]:
        """What of this process's torch settings the key holds: every config module and every global flag
        (:mod:`..torch_settings`), since the compile reads them all and the key is all a loader checks."""
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        def portable(config: Any) -> str:
            # private ones too (``_micro_pipeline_tp``, ``_unsafe_skip_fsdp_module_guards``): torch's FX key hashes them
            return stable_repr(keyed(config.save_config_portable(ignore_private_configs=False)))

        # the modules hashed whole from the start, as before; every other one by what differs from its
        # defaults (``torch.fx.experimental._config``, ``torch.compiler.config``, ...), so default keys stay put
        whole = {config.__name__ for config in (dynamo_config, inductor_config, functorch_config)}
        others = keyed_overrides(name for name in config_modules() if name not in whole)
        return {
            "compile": stable_repr((self.mode, self.options or {}, self.dynamic)),
            "dynamo_config": portable(dynamo_config),
            "inductor_config": portable(inductor_config),
            "functorch_config": portable(functorch_config),
            **({"configs": stable_repr(others)} if others else {}),
            "settings": stable_repr(settings()),
        }


def compile_on_one_rank() -> bool:
    """torch's compile-on-one-rank flag: ``torch.compiler.config``'s from 2.14 (``torch.distributed.config``'s
    is then a deprecated alias of it), ``torch.distributed.config``'s in 2.13."""
    import torch.compiler.config as compiler_config

    if hasattr(compiler_config, "compile_on_one_rank"):
        return bool(compiler_config.compile_on_one_rank)
    import torch.distributed.config as distributed_config

    return bool(getattr(distributed_config, "compile_on_one_rank", False))


@functools.cache
def toolchain() -> dict[str, str]:
    """What a loaded ``.so`` and its bytecode depend on besides the settings and the CPU: fixed per process.

    The CPU (and the compiler's view of it, with its version) is the host-CPU fingerprint
    in the key's prefix, the graph store's: a CPU kind that may not run another's graphs
    may not run its precompiled functions either.
    """
    return {
        "format": FORMAT,
        "torch": f"{torch.__version__}+{torch.version.git_version}",
        "libc": " ".join(platform.libc_ver()),
    }


def devices_fingerprint(devices: set[str]) -> str:
    """GPU name and toolkit version of every accelerator device the inputs live on."""
    parts = []
    for device in sorted(devices):
        kind = device.split(":")[0]
        if kind in ("cuda", "xpu"):
            module = getattr(torch, kind)
            parts.append(f"{device}={module.get_device_name(device)}|{getattr(torch.version, kind, None)}")
    return ";".join(parts)


def global_state() -> tuple[Any, ...]:
    """The global modes dynamo guards on (each changes the compiled graph)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        str(torch.get_default_dtype()),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
    )


def tensor_kind(value: torch.Tensor) -> str:
    """The tensor's type, and for a DTensor how it is laid out over its mesh: ``DTensor(Shard(dim=0),)@cpu(2,)('tp',)``.

    Its shape is the global one, the same for every placement; the placements and the mesh's
    shape say which local shard each rank holds, so a key does not serve another layout (torch's
    guard, ``DTENSOR_SPEC_MATCH``, would only refuse it). The mesh's coordinate and groups are left
    out: every rank of a job shares the key, and the groups the code names are checked apart
    (``Precompiled.groups``).
    """
    kind = type(value).__qualname__
    spec: Any = getattr(value, "_spec", None)
    if getattr(spec, "mesh", None) is None:
        return kind
    mesh = spec.mesh
    return f"{kind}{tuple(spec.placements)!r}@{mesh.device_type}{tuple(mesh.shape)}{mesh.mesh_dim_names or ''}"


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tensor_kind(value),
            str(value.dtype),
            str(value.device),
            str(value.layout),
            tuple(value.shape),
            value.stride(),
            value.requires_grad,
            _marked(value),
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return ("object", type(value).__module__, type(value).__qualname__)


def signature(owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """This call's guard inputs that are cheap to read (hashable): what the store key is made of."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    mode = owner.training if isinstance(owner, torch.nn.Module) else None
    return (str(spec), tuple(_leaf(x) for x in leaves), mode, global_state())


def call_key(owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What the dispatcher memoizes each call's :func:`signature` under, read in a fraction of its time.

    Two calls with equal call keys have equal signatures: for the common call (positional plain
    tensors, no keyword arguments) it holds the same facts as the signature, as torch's objects
    rather than their strings and without flattening the arguments (a plain tensor is a pytree
    leaf); any other call is keyed by its signature itself. Measured on cold_bench's GPT (torch
    2.13): 17 us per call for the signature, a few for this.
    """
    if kwargs or not all(type(x) is torch.Tensor for x in args):
        return signature(owner, args, kwargs)
    mode = owner.training if isinstance(owner, torch.nn.Module) else None
    return (
        len(args),
        tuple((x.dtype, x.device, x.layout, x.shape, x.stride(), x.requires_grad, _marked(x)) for x in args),
        mode,
        global_state(),
    )


def _marked(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions the user marked dynamic (``torch._dynamo.mark_dynamic``), as :func:`_leaf` reads them."""
    marked = getattr(x, "_dynamo_dynamic_indices", None)
    return tuple(sorted(marked)) if marked else ()


def key_signature(sig: tuple[Any, ...], dynamic: bool) -> tuple[Any, ...]:
    """``sig`` as it enters the store key: sizes and strides of dynamic dimensions left out (guards check them)."""
    spec, leaves, mode, state = sig
    projected = []
    for leaf in leaves:
        if leaf[0] == "tensor":
            sizes, strides, marked = leaf[5], leaf[6], leaf[8]
            free = {i for i in range(len(sizes)) if dynamic or i in marked}
            leaf = (
                *leaf[:5],
                tuple(None if i in free else n for i, n in enumerate(sizes)),
                tuple(None if i in free else n for i, n in enumerate(strides)),
                leaf[7],
            )
        projected.append(leaf)
    return (spec, tuple(projected), mode, state)


def module_state(module: torch.nn.Module) -> list[Any]:
    """Parameters, buffers and training flags: what guards check on the module besides the inputs."""
    return [
        [
            (name, str(p.dtype), str(p.device), tuple(p.shape), p.requires_grad, *_layout(p))
            for name, p in module.named_parameters()
        ],
        [(name, str(b.dtype), str(b.device), tuple(b.shape), *_layout(b)) for name, b in module.named_buffers()],
        [(name, m.training) for name, m in module.named_modules()],
    ]


def _layout(tensor: torch.Tensor) -> tuple[str, ...]:
    """A parameter's or buffer's :func:`tensor_kind` where it is not a plain tensor, else nothing (keys of plain
    modules as they were)."""
    kind = tensor_kind(tensor)
    return () if kind in ("Tensor", "Parameter") else (kind,)


# -- traced code ---------------------------------------------------------------------------
_tracing = threading.local()
_trace_lock = threading.Lock()
_trace_users = 0
_trace_original: Any = None


@contextmanager
def traced_code(first: Any) -> Iterator[set[Any]]:
    """The code objects of every function dynamo inlines in this thread while in the block (plus ``first``).

    Code of torch itself is left out (the torch build is in the key already), and so is
    code that comes from no file (generated code).
    """
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    global _trace_users, _trace_original
    codes: set[Any] = {first}
    with _trace_lock:
        if _trace_users == 0:
            _trace_original = InliningInstructionTranslator.inline_call_
            original = _trace_original

            def inline_call_(self: Any) -> Any:
                collecting = getattr(_tracing, "codes", None)
                if collecting is not None:
                    collecting.add(self.f_code)
                return original(self)

            InliningInstructionTranslator.inline_call_ = inline_call_
        _trace_users += 1
    previous = getattr(_tracing, "codes", None)
    _tracing.codes = codes
    try:
        yield codes
    finally:
        _tracing.codes = previous
        with _trace_lock:
            _trace_users -= 1
            if _trace_users == 0:
                InliningInstructionTranslator.inline_call_ = _trace_original
                _trace_original = None
        codes.difference_update(
            {c for c in codes if c.co_filename.startswith(_TORCH_DIR) or not os.path.isfile(c.co_filename)}
        )
