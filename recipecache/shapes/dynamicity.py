"""How many distinct input shapes a data loader produces, and which dimensions vary.

Under ``torch.compile`` every new input shape is a (re)compile until dynamo gives up and
marks the dimension dynamic, and past ``torch._dynamo.config.recompile_limit`` (8 by default)
shapes per frame it falls back to eager. Knowing the shape histogram of the data *before*
training says whether that will happen, and which input dimension to bucket or mark dynamic.
This is the torch.compile counterpart of Gaudi's ``data_dynamicity`` tool.

Batches may be tensors, numpy arrays, or any nesting of dicts, lists and tuples of them;
inputs are named by their path (``input_ids``, ``0.mask``). Nothing here imports torch: a
leaf with ``shape`` and ``dtype`` attributes is a tensor.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeGuard

from ..errors import ConfigError
from ._table import format_table

log = logging.getLogger(__name__)

#: Path of a batch that is itself a single tensor.
ROOT_PATH = "<batch>"

#: Up to this many distinct shapes the verdict is "little": each compiles once and all of them
#: fit in dynamo's default ``recompile_limit`` (8), so nothing falls back to eager.
LITTLE_MAX_SHAPES = 8
#: Up to this many distinct shapes the verdict is "some"; more is "a lot". Past the recompile
#: limit the choice is between bucketing and dynamic shapes; past 64 shapes static compiles
#: cost more than a bucketed run would, whatever the model.
SOME_MAX_SHAPES = 64

#: Python scalars riding along in a batch (ids, flags, strings collated into lists) do not
#: change tensor shapes, so they are not part of a signature.
SCALAR_TYPES = (str, bytes, int, float, bool, type(None))

#: One input of a batch: (path, shape, dtype).
TensorSpec = tuple[str, tuple[int, ...], str]
Signature = tuple[TensorSpec, ...]


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def iter_leaves(obj: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Every non-container value of a nested batch with its dotted path.

    Mappings contribute their keys, namedtuples their field names, lists and tuples their
    indices, so the paths read like the code that built the batch.
    """
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_leaves(value, _join(prefix, key))
    elif isinstance(obj, (list, tuple)):
        names = getattr(obj, "_fields", None) or range(len(obj))
        for name, value in zip(names, obj, strict=False):
            yield from iter_leaves(value, _join(prefix, name))
    else:
        yield prefix or ROOT_PATH, obj


class TensorLike(Protocol):
    shape: Sequence[int]
    dtype: object


def is_tensor_like(obj: object) -> TypeGuard[TensorLike]:
    """True for torch tensors, numpy arrays and anything else that has a shape and a dtype."""
    return hasattr(obj, "shape") and hasattr(obj, "dtype")


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def batch_signature(batch: object) -> Signature:
    """The (path, shape, dtype) of every tensor in ``batch``, in the batch's own order.

    Raises :class:`ConfigError` naming the path of a value that is neither a tensor, a
    container nor a Python scalar, or when the batch holds no tensor at all: both mean the
    loader is not yielding what the model will be compiled for.
    """
    specs: list[TensorSpec] = []
    for path, leaf in iter_leaves(batch):
        if is_tensor_like(leaf):
            specs.append((path, tuple(int(size) for size in leaf.shape), _dtype_name(leaf.dtype)))
        elif not isinstance(leaf, SCALAR_TYPES):
            raise ConfigError(f"unsupported value of type {type(leaf).__name__} at {path!r} in a batch")
    if not specs:
        raise ConfigError(f"batch of type {type(batch).__name__} holds no tensors")
    return tuple(specs)


def format_signature(signature: Signature) -> str:
    return "  ".join(f"{path}=[{', '.join(map(str, shape))}] {dtype}" for path, shape, dtype in signature)


@dataclass(frozen=True)
class DimVariation:
    """One input dimension whose size changes between batches, and what to do about it."""

    path: str
    dim: int
    role: str
    sizes: dict[int, int]  # size -> number of batches
    suggestion: str

    @property
    def min(self) -> int:
        return min(self.sizes)

    @property
    def max(self) -> int:
        return max(self.sizes)


_ROLES = {
    2: {1: "sequence"},
    3: {1: "sequence", 2: "features"},
    4: {1: "channels", 2: "height", 3: "width"},
    5: {1: "channels", 2: "depth", 3: "height", 4: "width"},
}


def dim_role(ndim: int, dim: int) -> str:
    """Conventional meaning of a dimension (NCHW, batch-first sequences); a guess for the reader."""
    return "batch" if dim == 0 else _ROLES.get(ndim, {}).get(dim, f"dim{dim}")


def _suggest(path: str, dim: int, role: str, sizes: Mapping[int, int]) -> str:
    """The cheapest fix first: drop a ragged last batch, tolerate a few sizes, otherwise bucket."""
    lo, hi = min(sizes), max(sizes)
    mark = f"torch._dynamo.mark_dynamic({path}, {dim}, min={max(lo, 2)}, max={hi})"
    maybe = f"torch._dynamo.maybe_mark_dynamic({path}, {dim})"
    if role == "batch" and len(sizes) == 2 and sizes[lo] == 1:
        return f"only a ragged last batch is smaller: DataLoader(drop_last=True), or {maybe}"
    if len(sizes) <= LITTLE_MAX_SHAPES:
        return f"{len(sizes)} sizes compile once each; or {maybe}"
    if role == "batch":
        return f"{mark}, or a fixed batch size"
    return f"bucket {path!r} dim {dim}: recipecache.optimal_buckets(per-item lengths, k) + BucketPadCollate; or {mark}"


def _variations(signatures: Counter[Signature]) -> list[DimVariation]:
    sizes: dict[tuple[str, int, int], Counter[int]] = {}
    for signature, count in signatures.items():
        for path, shape, _ in signature:
            for dim, size in enumerate(shape):
                sizes.setdefault((path, len(shape), dim), Counter())[size] += count
    found = []
    for (path, ndim, dim), histogram in sizes.items():
        if len(histogram) > 1:
            role = dim_role(ndim, dim)
            suggestion = _suggest(path, dim, role, histogram)
            found.append(DimVariation(path, dim, role, dict(sorted(histogram.items())), suggestion))
    return found


def verdict_for(unique_shapes: int) -> str:
    if unique_shapes <= LITTLE_MAX_SHAPES:
        return "little"
    return "some" if unique_shapes <= SOME_MAX_SHAPES else "a lot"


@dataclass(frozen=True)
class DynamicityReport:
    """Shape histogram of a loader: ``signatures`` most common first, then first seen."""

    batches: int
    signatures: list[tuple[Signature, int]]
    varying: list[DimVariation]

    @property
    def unique_shapes(self) -> int:
        return len(self.signatures)

    @property
    def verdict(self) -> str:
        """``little``, ``some`` or ``a lot`` of dynamicity (see :data:`LITTLE_MAX_SHAPES`)."""
        return verdict_for(self.unique_shapes)

    def to_dict(self) -> dict[str, object]:
        return {
            "batches": self.batches,
            "unique_shapes": self.unique_shapes,
            "verdict": self.verdict,
            "signatures": [
                {
                    "count": count,
                    "inputs": [{"path": p, "shape": list(s), "dtype": d} for p, s, d in signature],
                }
                for signature, count in self.signatures
            ],
            "varying": [{**asdict(v), "sizes": {str(size): n for size, n in v.sizes.items()}} for v in self.varying],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def format(self, max_rows: int = 20) -> str:
        """The readable report; at most ``max_rows`` signatures, the rest summarised in one line."""
        head = (
            f"{self.batches} batches, {self.unique_shapes} unique shapes: {self.verdict} dynamicity "
            f"(little <= {LITTLE_MAX_SHAPES} < some <= {SOME_MAX_SHAPES} < a lot)"
        )
        rows = [
            (count, f"{100.0 * count / self.batches:.1f}%", format_signature(signature))
            for signature, count in self.signatures[:max_rows]
        ]
        parts = [head, format_table(("count", "share", "shapes"), rows)]
        if len(self.signatures) > max_rows:
            rest = sum(count for _, count in self.signatures[max_rows:])
            parts.append(f"... {len(self.signatures) - max_rows} more shapes in {rest} batches")
        if self.varying:
            parts.append("varying dimensions:")
            parts.append(
                format_table(
                    ("input", "dim", "role", "sizes", "min", "max", "suggestion"),
                    [(v.path, v.dim, v.role, len(v.sizes), v.min, v.max, v.suggestion) for v in self.varying],
                )
            )
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.format()


def data_dynamicity(loader: Iterable[object], *, max_batches: int | None = None) -> DynamicityReport:
    """Walk ``loader`` (a DataLoader or any iterable of batches) and histogram its batch shapes.

    Only shapes are read; with ``max_batches`` the walk stops early, which is enough for
    shuffled loaders whose shape mix is stationary.
    """
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"max_batches must be >= 1, got {max_batches}")
    signatures: Counter[Signature] = Counter()
    batches = 0
    for batch in loader:
        try:
            signatures[batch_signature(batch)] += 1
        except ConfigError as exc:
            raise ConfigError(f"batch {batches}: {exc}") from None
        batches += 1
        if max_batches is not None and batches >= max_batches:
            break
    if not batches:
        raise ConfigError("the loader yielded no batches")
    report = DynamicityReport(batches, signatures.most_common(), _variations(signatures))
    log.info("data_dynamicity: %d batches, %d unique shapes (%s)", batches, report.unique_shapes, report.verdict)
    return report
