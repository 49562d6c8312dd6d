"""Which submodule makes torch.compile recompile, and why.

The torch.compile counterpart of Gaudi's ``detect_recompilation_auto_model``. A model whose
graph is recompiled step after step stalls training, and the global compile counter does not
say where the dynamism lives. :func:`detect_recompilation` instruments every submodule so
that each one's own code is compiled on its own: its ``forward`` becomes a small eager
wrapper (a ``torch._dynamo.disable`` function, so the parent's graph breaks at the child
call) that records the input and output shapes and runs the original ``forward`` through
``torch.compile`` with a counting backend. Every graph the backend sees is charged to the
module whose call is innermost at that moment, so per step and module we know whether it
was (re)compiled, by its own code or by a child's, and whether its input or output shape
was new. The comments follow the Gaudi tool:

* ``first compilation`` - the module's first step;
* ``recompiled due to a new input shape``;
* ``already-seen input shape still recompiled (dynamic ops)`` - same input, but its own code
  compiled again: a data-dependent op (``x[x > 0]``, ``nonzero``, ``unique``) produced a
  shape dynamo had not seen;
* ``recompiled because of a dynamic child`` - same input, and only children (or its own code
  consuming a child's new output shape) compiled.

The split at module boundaries adds graph breaks, so this is a diagnostic mode for a few
steps, not a way to train. Graph breaks and data-dependent ops of the *unsplit* model come
from ``torch._dynamo.explain`` on the first batch, and from the ``unbacked_bindings`` of ops
captured in a graph (with ``capture_dynamic_output_shape_ops``); dynamo's own guard-failure
reason is attached to every recompile.
"""

from __future__ import annotations

import csv
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import CodeType
from typing import Any

import torch
from torch._dynamo.utils import get_compilation_metrics
from torch._guards import CompileContext

from ..errors import ConfigError
from ._table import format_table
from .dynamicity import SCALAR_TYPES, is_tensor_like, iter_leaves

log = logging.getLogger(__name__)

ROOT = "<root>"

FIRST = "first compilation"
NEW_INPUT_SHAPE = "recompiled due to a new input shape"
DYNAMIC_OPS = "already-seen input shape still recompiled (dynamic ops)"
DYNAMIC_CHILD = "recompiled because of a dynamic child"

STEPS_CSV = "recompilation_steps.csv"
SUMMARY_CSV = "recompilation_summary.csv"

#: Graph-break reasons that mean an op's output shape depends on tensor *values*.
_DATA_DEPENDENT = re.compile(r"dynamic shape operator|data[- ]dependent", re.IGNORECASE)
_STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n(?P<code>[^\n]*)')


def _call_signature(obj: object) -> tuple[tuple[str, object], ...]:
    """What dynamo guards on in a call's arguments or result: tensor shapes and dtypes, and
    the values of Python scalars (dynamo specialises on them); other objects by type."""
    signature: list[tuple[str, object]] = []
    for path, leaf in iter_leaves(obj):
        if is_tensor_like(leaf):
            signature.append((path, (tuple(leaf.shape), str(leaf.dtype))))
        elif isinstance(leaf, SCALAR_TYPES):
            signature.append((path, leaf))
        else:
            signature.append((path, type(leaf).__qualname__))
    return tuple(signature)


@dataclass
class RecompileRow:
    """One module in one step: the graphs compiled while it ran and whether its shapes were new."""

    step: int
    module: str
    cls: str
    graphs: int  # graphs compiled during its calls, its children's included
    own_graphs: int  # graphs of its own code
    new_input: bool
    new_output: bool
    comment: str = ""
    reasons: list[str] = field(default_factory=list)  # dynamo's guard failures behind its own recompiles


@dataclass(frozen=True)
class ModuleSummary:
    module: str
    cls: str
    calls: int
    recompiles: int  # steps after its first compilation in which it compiled again
    new_input_shape: int
    dynamic_ops: int
    dynamic_child: int
    verdict: str


@dataclass(frozen=True)
class DynamicOpFinding:
    """A graph break or a data-dependent op, with the source line that causes it."""

    kind: str  # "data-dependent op" or "graph break"
    detail: str
    module: str
    location: str  # file:line
    code: str


@dataclass
class _Call:
    path: str
    graphs_at_start: int
    own_graphs: int = 0
    compile_ids: list[str] = field(default_factory=list)
    child_new_output: bool = False


@dataclass
class _Entry:
    """Everything recorded for one (step, module); becomes a :class:`RecompileRow` if it compiled."""

    row: RecompileRow
    first: bool
    child_new_output: bool = False


def _comment(entry: _Entry) -> str:
    """Why a module compiled in a step, most specific cause first (see the module docstring)."""
    if entry.first:
        return FIRST
    if entry.row.new_input:
        return NEW_INPUT_SHAPE
    if entry.row.own_graphs and not entry.child_new_output:
        return DYNAMIC_OPS
    return DYNAMIC_CHILD


def _short(reason: str) -> str:
    return reason.strip().splitlines()[0] if reason.strip() else ""


def _trampoline(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls ``forward``, with a code object of its own, for torch.compile.

    Dynamo keeps its cache, and its recompile limit, per code object. Compiling each
    class's ``forward`` through its own trampoline gives every class its own cache (graphs
    are still shared between instances of a class: 12 identical layers compile once) and
    guard-failure reasons about that class's inputs. Compiling ``forward`` directly would
    put every ``torch.nn`` layer (files dynamo does not trace as top-level frames) behind one
    shared wrapper whose cache fills up across classes and then silently runs eagerly.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    name = getattr(forward, "__qualname__", type(forward).__name__)
    call.__code__ = call.__code__.replace(co_name=f"recompile_probe_{re.sub(r'[^0-9A-Za-z_]', '_', name)}")
    return call


class RecompilationDetector:
    """Runs a model with per-module compile accounting; see the module docstring.

    Call it (or the model itself) once per training step, then read
    :meth:`analyse_dynamicity`. :meth:`restore` (or leaving a ``with`` block) puts the
    original ``forward`` methods back.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        backend: str | Callable[..., Any] = "eager",
        dynamic: bool | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"detect_recompilation needs a torch.nn.Module, got {type(model).__name__}")
        self.model: torch.nn.Module = getattr(model, "_orig_mod", model)  # unwrap an OptimizedModule
        self._inner_backend: Callable[..., Callable[..., Any]] = (
            torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        )
        self._dynamic = dynamic
        self.step = 0
        self._graphs = 0
        self._stack: list[_Call] = []
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._seen_inputs: dict[str, set[object]] = {}
        self._seen_outputs: dict[str, set[object]] = {}
        self._calls: Counter[str] = Counter()
        self._graph_findings: list[DynamicOpFinding] = []
        self._explained: list[DynamicOpFinding] | None = None
        self._example: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        self._originals: dict[str, Any] = {}  # path -> the instance-level forward it replaced (or None)
        self._install()
        self._installed = True

    # -- instrumentation -----------------------------------------------------------------

    def _paths(self) -> Iterator[tuple[str, torch.nn.Module]]:
        for name, module in self.model.named_modules():
            yield name or ROOT, module

    def _install(self) -> None:
        for path, module in self._paths():
            self._originals.setdefault(path, module.__dict__.get("forward"))
            module.forward = self._wrap(path, module)

    def _uninstall(self) -> None:
        for path, module in self._paths():
            original = self._originals.get(path)
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original

    def restore(self) -> torch.nn.Module:
        """Put the original ``forward`` methods back and return the model."""
        if self._installed:
            self._uninstall()
            self._installed = False
        return self.model

    def __enter__(self) -> RecompilationDetector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _compiled_for(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        if forward not in self._compiled:
            self._compiled[forward] = torch.compile(_trampoline(forward), backend=self._count, dynamic=self._dynamic)
        return self._compiled[forward]

    def _wrap(self, path: str, module: torch.nn.Module) -> Callable[..., Any]:
        bound = module.forward
        # A bound method compiles through its class function, so instances share one cache.
        func = getattr(bound, "__func__", None)
        compiled = self._compiled_for(func if func is not None else bound)
        head = (module,) if func is not None else ()

        @torch._dynamo.disable
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self._stack and self._example is None:
                self._example = (args, kwargs)
            call = _Call(path, self._graphs)
            self._stack.append(call)
            try:
                output = compiled(*head, *args, **kwargs)
            finally:
                self._stack.pop()
            self._record(call, type(module).__name__, _call_signature((args, kwargs)), _call_signature(output))
            return output

        return forward

    def _count(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The backend: charge the graph to the innermost running module, note data-dependent
        ops in it, then hand it to the real backend."""
        self._graphs += 1
        path = ROOT
        if self._stack:
            call = self._stack[-1]
            call.own_graphs += 1
            call.compile_ids.append(str(CompileContext.current_compile_id()))
            path = call.path
        self._graph_findings.extend(_unbacked_ops(gm, path))
        return self._inner_backend(gm, example_inputs)

    def _record(self, call: _Call, cls: str, inputs: object, output: object) -> None:
        key = (self.step, call.path)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(
                RecompileRow(self.step, call.path, cls, 0, 0, False, False),
                first=call.path not in self._calls,
            )
            self._entries[key] = entry
        self._calls[call.path] += 1
        row = entry.row
        row.graphs += self._graphs - call.graphs_at_start
        row.own_graphs += call.own_graphs
        row.reasons.extend(_recompile_reasons(call.compile_ids))
        seen_in = self._seen_inputs.setdefault(call.path, set())
        seen_out = self._seen_outputs.setdefault(call.path, set())
        new_output = output not in seen_out
        row.new_input |= inputs not in seen_in
        row.new_output |= new_output
        seen_in.add(inputs)
        seen_out.add(output)
        entry.child_new_output |= call.child_new_output
        if self._stack:
            self._stack[-1].child_new_output |= new_output
        else:
            self.step += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One training step's forward."""
        return self.model(*args, **kwargs)

    # -- analysis ------------------------------------------------------------------------

    @property
    def rows(self) -> list[RecompileRow]:
        """Per step, every module that compiled while it ran, with the Gaudi-style comment."""
        return [replace(entry.row, comment=_comment(entry)) for entry in self._entries.values() if entry.row.graphs]

    def summary(self) -> list[ModuleSummary]:
        """Per module, how often and why it recompiled; most recompiles first."""
        comments: dict[str, Counter[str]] = {}
        classes: dict[str, str] = {}
        for row in self.rows:
            comments.setdefault(row.module, Counter())[row.comment] += 1
            classes[row.module] = row.cls
        result = []
        for path, counts in comments.items():
            recompiles = sum(n for comment, n in counts.items() if comment != FIRST)
            if counts[DYNAMIC_OPS]:
                verdict = "dynamic ops: make them shape-static (torch.where, fixed-size masks)"
            elif counts[NEW_INPUT_SHAPE]:
                verdict = "input shapes vary: bucket and pad the data, or mark the dimension dynamic"
            elif counts[DYNAMIC_CHILD]:
                verdict = "static itself: a child is dynamic"
            else:
                verdict = "static after its first compilation"
            result.append(
                ModuleSummary(
                    path,
                    classes[path],
                    self._calls[path],
                    recompiles,
                    counts[NEW_INPUT_SHAPE],
                    counts[DYNAMIC_OPS],
                    counts[DYNAMIC_CHILD],
                    verdict,
                )
            )
        result.sort(key=lambda s: (-s.recompiles, -s.dynamic_ops, s.module))
        return result

    def findings(self) -> list[DynamicOpFinding]:
        """Graph breaks and data-dependent ops, with their source lines.

        The first call runs ``torch._dynamo.explain`` once on the first batch with the
        original ``forward`` methods (buffers such as BatchNorm statistics are restored).
        """
        if self._explained is None:
            self._explained = self._explain(*self._example) if self._example is not None else []
        unique: dict[tuple[str, str, str], DynamicOpFinding] = {}
        for finding in [*self._explained, *self._graph_findings]:
            unique.setdefault((finding.kind, finding.detail, finding.location), finding)
        return list(unique.values())

    def _explain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DynamicOpFinding]:
        saved = {name: buffer.clone() for name, buffer in self.model.named_buffers()}
        self._uninstall()
        try:
            with torch.no_grad():
                explained = torch._dynamo.explain(self.model)(*args, **kwargs)
        finally:
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(saved[name])
            if self._installed:
                self._install()
        index = _forward_index(self.model)
        found = []
        for reason in explained.break_reasons:
            frame = reason.user_stack[-1] if reason.user_stack else None
            kind = "data-dependent op" if _DATA_DEPENDENT.search(reason.reason) else "graph break"
            detail = _short(reason.reason)
            context = re.search(r"Developer debug context: (\S+)", reason.reason)
            if context:
                detail = f"{detail} ({context.group(1)})"
            if frame is None:
                found.append(DynamicOpFinding(kind, detail, "", "", ""))
                continue
            module = index.get((frame.filename, frame.name), [])
            owner = next((path for path, first, last in module if first <= (frame.lineno or 0) <= last), "")
            found.append(
                DynamicOpFinding(kind, detail, owner, f"{frame.filename}:{frame.lineno}", (frame.line or "").strip())
            )
        return found

    def _step_rows(self) -> tuple[tuple[str, ...], list[tuple[object, ...]]]:
        headers = ("step", "module", "class", "graphs", "own", "new input", "new output", "comment", "reason")
        rows: list[tuple[object, ...]] = [
            (
                r.step,
                r.module,
                r.cls,
                r.graphs,
                r.own_graphs,
                r.new_input,
                r.new_output,
                r.comment,
                _short(r.reasons[-1]) if r.reasons else "",
            )
            for r in self.rows
        ]
        return headers, rows

    def analyse_dynamicity(self, csv_dir: str | Path | None = ".") -> str:
        """The per-step table, the per-module summary and the findings, as text.

        Also writes the first two as ``recompilation_steps.csv`` and
        ``recompilation_summary.csv`` under ``csv_dir`` (the Gaudi tool writes CSVs to the
        working directory too); ``csv_dir=None`` writes nothing.
        """
        step_headers, step_rows = self._step_rows()
        summary = self.summary()
        summary_headers = tuple(f.name for f in fields(ModuleSummary))
        summary_rows = [tuple(asdict(s).values()) for s in summary]
        findings = self.findings()
        parts = [
            f"recompilation per step ({self.step} steps):",
            format_table(step_headers, step_rows) if step_rows else "(nothing compiled)",
            "per module, most recompiles first:",
            format_table(summary_headers, summary_rows) if summary_rows else "(no module compiled)",
        ]
        if findings:
            parts.append("graph breaks and data-dependent ops:")
            parts.append(
                format_table(
                    ("kind", "detail", "module", "location", "code"),
                    [tuple(asdict(f).values()) for f in findings],
                )
            )
        else:
            parts.append("no graph breaks or data-dependent ops found")
        if csv_dir is not None:
            directory = Path(csv_dir)
            directory.mkdir(parents=True, exist_ok=True)
            for name, headers, rows in (
                (STEPS_CSV, step_headers, step_rows),
                (SUMMARY_CSV, summary_headers, summary_rows),
            ):
                with open(directory / name, "w", newline="") as handle:
                    writer = csv.writer(handle)
                    writer.writerow(headers)
                    writer.writerows(rows)
            log.info("recompilation analysis written to %s and %s", directory / STEPS_CSV, directory / SUMMARY_CSV)
        return "\n".join(parts)


def _recompile_reasons(compile_ids: list[str]) -> list[str]:
    """Dynamo's guard-failure reason for each recompile among ``compile_ids``, if it still
    remembers it (its metrics keep the most recent compiles only)."""
    if not compile_ids:
        return []
    wanted = set(compile_ids)
    return [m.recompile_reason for m in get_compilation_metrics() if str(m.compile_id) in wanted and m.recompile_reason]


def _unbacked_ops(gm: torch.fx.GraphModule, path: str) -> list[DynamicOpFinding]:
    """Ops in a captured graph whose output size is a fresh data-dependent symbol."""
    found = []
    for node in gm.graph.nodes:
        if not node.meta.get("unbacked_bindings"):
            continue
        frames = list(_STACK_FRAME.finditer(node.meta.get("stack_trace") or ""))
        where = frames[-1] if frames else None
        target = getattr(node.target, "__name__", str(node.target))
        found.append(
            DynamicOpFinding(
                "data-dependent op",
                f"{target}: output size depends on tensor values (captured in the graph)",
                path,
                f"{where['file']}:{where['line']}" if where else "",
                where["code"].strip() if where else "",
            )
        )
    return found


def _forward_index(model: torch.nn.Module) -> dict[tuple[str, str], list[tuple[str, int, int]]]:
    """(file, function name) -> (module path, first line, last line) of each module's ``forward``,
    to name the module a graph-break frame belongs to."""
    index: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    for name, module in model.named_modules():
        code: CodeType | None = getattr(type(module).forward, "__code__", None)
        if code is None:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        index.setdefault((code.co_filename, code.co_name), []).append(
            (name or ROOT, code.co_firstlineno, max(lines, default=code.co_firstlineno))
        )
    return index


def detect_recompilation(
    model: torch.nn.Module, *, backend: str | Callable[..., Any] = "eager", dynamic: bool | None = None
) -> RecompilationDetector:
    """Instrument ``model`` to find the submodule that makes torch.compile recompile.

    Run a few steps through the returned detector (or the model), then print
    ``detector.analyse_dynamicity()``. ``backend`` defaults to ``eager``: which graphs dynamo
    captures, and when it recaptures them, does not depend on the backend, and skipping
    code generation keeps the diagnosis quick; ``dynamic`` is passed to ``torch.compile``.
    """
    return RecompilationDetector(model, backend=backend, dynamic=dynamic)
