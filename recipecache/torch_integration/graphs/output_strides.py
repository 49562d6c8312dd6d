"""The record of a forward's output strides (overlap): what its leader publishes, and the checks a waiter applies
before handing it to torch.

A process that finds a forward busy reports the strides its leader published to AOTAutograd,
which compiles the backward for them (:meth:`.overlap.Overlap.defer_busy`). torch reads each
stride as code: with a shape environment ``ShapeEnv.deserialize_symexpr`` ``eval``s the string,
and without one ``int()`` takes it. So the record is checked like an artifact before torch sees
it, beyond the store's envelope (checksummed, and signed when a secret is set; an unsigned store
takes whatever anybody writes): it must name the graph it belongs to, hold one entry per output
of the graph being compiled, and each stride must be a plain number (ASCII digits,
:mod:`recipecache.quantities`) or an expression of a few arithmetic operators over the graph's own
size symbols only, whose value (at the symbols' hints) lays the output out without two elements
on one address. A plausible but wrong record (every stride ``0``) compiled the backward for
another layout than the forward's, and the step then stopped on torch's stride assertion.
A record that fails is the caller's counted fallback: it compiles, or waits for, the graph itself.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ... import quantities

#: a stride as text: longer ones are no stride inductor prints
MAX_STRIDE_CHARS = 200
#: the functions a stride may call, as the printer spells them (``Max``/``Min`` of sizes)
FUNCTIONS = {"sym_max": max, "sym_min": min}
#: the tokens a stride is made of (anything else, such as quotes, brackets or other scripts' digits, is refused
#: before it is parsed)
_TOKENS = re.compile(r"[A-Za-z0-9_ .+\-*/%(),]*\Z")
#: largest exponent of a power in a stride (``s0**2``)
MAX_POWER = 8

Strides = list[list[str] | None]


def record(key: str, strides: Strides) -> bytes:
    """The record the leader of forward ``key`` publishes: the strides (torch's strings, None where unknown), named
    by the graph they belong to."""
    return json.dumps({"graph": key, "strides": strides}).encode()


def check(data: bytes, key: str, outputs: Sequence[Any] | None, example_inputs: Sequence[Any]) -> Strides | str:
    """The strides in ``data`` if they fit forward ``key`` whose outputs (the FX graph's output values, None when
    unknown) are ``outputs`` and whose inputs are ``example_inputs``; else what is wrong with them (one line)."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return "not JSON"
    if not isinstance(parsed, dict) or set(parsed) != {"graph", "strides"}:
        return "not an output strides record"
    if parsed["graph"] != key:
        return "the record of another graph"
    strides = parsed["strides"]
    if not isinstance(strides, list) or outputs is None or len(strides) != len(outputs):
        count = "?" if outputs is None else len(outputs)
        return f"{len(strides) if isinstance(strides, list) else '?'} entries for a graph of {count} outputs"
    hints = _symbol_hints(example_inputs)
    for index, (entry, output) in enumerate(zip(strides, outputs, strict=True)):
        problem = None if entry is None else _check_output(entry, output, hints)
        if problem is not None:
            return f"output {index}: {problem}"
    return strides


def graph_outputs(gm: Any) -> list[Any] | None:
    """The values (``meta['val']``, None where absent) of the outputs of FX graph ``gm``, as inductor counts its
    ``graph_outputs``; None when ``gm`` is no graph."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return None
    node = next((n for n in graph.nodes if n.op == "output"), None)
    if node is None:
        return None
    values = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
    return [getattr(value, "meta", {}).get("val") for value in values]


def _check_output(entry: object, output: Any, hints: dict[str, int]) -> str | None:
    import torch

    if not isinstance(entry, list) or not all(isinstance(stride, str) for stride in entry):
        return "not a list of strides"
    if not isinstance(output, torch.Tensor):
        return "strides for an output that is no tensor"
    if len(entry) != output.dim():
        return f"{len(entry)} strides for {output.dim()} dimensions"
    values = []
    for stride in entry:
        value = _value(stride, hints)
        if value is None:
            return f"stride {stride[:40]!r} is no number or expression of the graph's sizes"
        values.append(value)
    sizes = [_hint(size) for size in output.shape]
    if None in sizes:
        return None  # sizes without a hint (unbacked): torch checks what it can
    if not _non_overlapping([s for s in sizes if s is not None], values):
        return f"strides {entry} put two elements of shape {tuple(sizes)} at one address"
    return None


def _non_overlapping(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` give each element of a tensor of ``sizes`` its own address (an empty tensor has none)."""
    if 0 in sizes:
        return True
    reach = 1
    for size, stride in sorted(((s, t) for s, t in zip(sizes, strides, strict=True) if s > 1), key=lambda st: st[1]):
        if stride < reach:
            return False
        reach = stride * size
    return True


def _hint(size: Any) -> int | None:
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else None


def _symbol_hints(example_inputs: Iterable[Any]) -> dict[str, int]:
    """The graph's own size symbols (those its inputs' sizes, strides and integers are made of), each with its hint."""
    import torch

    values: list[Any] = []
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            values += [*value.shape, *value.stride()]
        elif isinstance(value, torch.SymInt):
            values.append(value)
    hints: dict[str, int] = {}
    for value in values:
        node = getattr(value, "node", None)
        if node is None:
            continue
        shape_env = node.shape_env
        for symbol in node.expr.free_symbols:
            hint = shape_env.var_to_val.get(symbol)
            if hint is not None and getattr(hint, "is_integer", False):
                hints[str(symbol)] = int(hint)
    return hints


def _value(text: str, hints: dict[str, int]) -> int | None:
    """The value of stride ``text`` at the symbols' hints, if it is a number or an allowed expression of the graph's
    symbols and at least 0; else None (nothing is evaluated but the checked tree)."""
    if len(text) > MAX_STRIDE_CHARS or not _TOKENS.match(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return None
    try:
        value = _evaluate(tree.body, text, hints)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if value >= 0 else None


def _evaluate(node: ast.AST, text: str, hints: dict[str, int]) -> int:
    """The value of one node of a stride's tree; ValueError for anything but numbers, the graph's symbols, a sign,
    ``+ - * // % **`` and the functions of :data:`FUNCTIONS`."""
    if isinstance(node, ast.Constant):
        number = quantities.whole(ast.get_source_segment(text, node) or "", 0, 2**63 - 1)
        if number is None:  # 1_0, 0x10, 1.5, a string: no number by the rule
            raise ValueError("not a whole number")
        return number
    if isinstance(node, ast.Name) and node.id in hints:
        return hints[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):  # torch prints ``(-1) + s0``
        operand = _evaluate(node.operand, text, hints)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, text, hints), _evaluate(node.right, text, hints)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.FloorDiv):
            return left // right
        if isinstance(node.op, ast.Mod):
            return left % right
        if isinstance(node.op, ast.Pow) and 0 <= right <= MAX_POWER:
            return int(left**right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and node.func.attr in FUNCTIONS
        and len(node.args) >= 2
        and not node.keywords
    ):
        return int(FUNCTIONS[node.func.attr](_evaluate(arg, text, hints) for arg in node.args))
    raise ValueError(f"not allowed in a stride: {type(node).__name__}")
