"""Graphs that differ between ranks only in which process group they use: one key per job, bound per rank.

Tensor, sequence and expert parallel graphs carry their collectives, and torch bakes the
process group's *name* into them (``_c10d_functional.all_reduce(x, 'sum', '3')`` on ranks 0-1
of a dp=2 x tp=2 mesh, ``'4'`` on ranks 2-3). torch's FX key (``compiled_fx_graph_hash``) then
differs between TP groups in

* the graph code (the group-name literals), and
* the ``DeviceMesh`` that dynamo passes to the graph as an opaque input: torch pickles it
  whole, with this rank's ``_rank``, ``_coordinate_on_dim``, its dimension groups' names and
  a ``_hash`` of them. Pickling it also turns the pickler's ``fast`` mode off
  (``FxGraphCachePickler._reduce_fake_script_object``), so from there on equal strings are
  memoised: an inductor config value that happens to equal one of the mesh's group names
  (``layout_opt_default = '1'``, the name of rank 0's dp group) is written as a reference on
  rank 0 and as a string on rank 1. That is why ranks of the *same* TP group, with identical
  AOT graphs, got different keys too, and why torch's per-component hash lines (each pickled
  on its own) were all equal while the keys were not.

:func:`bind` computes a rank-independent key for such a graph: the same hash details,
pickled with every group name replaced by a placeholder naming the group's *role*, the
group's ranks relative to its first one (``2@0,1`` is "a group of 2 consecutive ranks",
the TP group of every rank; ``2@0,2`` the dp group), and the mesh reduced to what all its
ranks share (device type, shape, dimension names and those roles). The graph torch
compiled is stored with the placeholders in its code (:meth:`Binding.canonical_graph`), so
the stored bytes name no real group; a rank that loads it replaces each placeholder with
*its own* group of that role (:func:`rebind_graph`), after the envelope was verified.

The mapping comes from this rank's own process groups only, so a rank can only ever be
bound to a group it belongs to. What cannot be mapped one to one (two of this rank's
groups with the same role, a group name used outside a collective call, a placeholder this
rank has no group for) raises :class:`RankBound`: the graph stays keyed per rank (torch's
own key), counted with that reason.
"""

from __future__ import annotations

import base64
import functools
import json
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: what a group name becomes in a shared key and in stored code; never a real group's name
PLACEHOLDER_PREFIX = "recipecache-group:"
#: a quoted string literal in Python source (FX code, inductor's wrapper code)
_LITERAL = re.compile(r"""(['"])([^'"\\\n]*)\1""")
#: graph fields of inductor's compiled graph (``CompiledFxGraph``) that quote group names
GRAPH_TEXT_FIELDS = ("source_code", "runnable_graph_str", "inductor_post_grad_graph_str")
#: fields that must be text for a graph to be rebound (``source_code`` is what runs)
_RUNNABLE = "source_code"


class RankBound(Exception):
    """This graph cannot share a key with other ranks' graphs; the message says why (for the counted reason).

    ``identity``: where :func:`bind` raised it, the graph's key with every group named by its
    role even where that is ambiguous: not safe to share artifacts under, but equal on every
    rank tracing the same code, so reports can tell that the ranks compiled one graph.
    """

    identity: str | None = None


@dataclass(frozen=True)
class Groups:
    """This rank's process groups: each group's name and rank-independent role."""

    #: name -> role (``<size>@<ranks relative to the first>``)
    roles: Mapping[str, str]

    @functools.cached_property
    def ambiguous(self) -> frozenset[str]:
        """Names whose role another of this rank's groups shares: which one a placeholder means is unknown."""
        seen: dict[str, int] = {}
        for role in self.roles.values():
            seen[role] = seen.get(role, 0) + 1
        return frozenset(name for name, role in self.roles.items() if seen[role] > 1)

    def placeholder(self, name: str, *, strict: bool = True) -> str:
        """The placeholder of this rank's group ``name`` (:class:`RankBound` if its role is not unique, unless not
        ``strict``: then only for identities, never for stored code)."""
        if strict and name in self.ambiguous:
            raise RankBound(
                f"process group {name!r}: another group of this rank has the same ranks pattern ({self.roles[name]})"
            )
        return PLACEHOLDER_PREFIX + self.roles[name]

    def local(self, placeholder: str) -> str:
        """This rank's group for ``placeholder`` (:class:`RankBound` if it has none, or more than one)."""
        role = placeholder[len(PLACEHOLDER_PREFIX) :]
        names = [name for name, r in self.roles.items() if r == role]
        if len(names) != 1:
            raise RankBound(f"this rank has {len(names)} process groups of role {role} for a stored graph")
        return names[0]

    def describe(self, name: str) -> str:
        """``'3' (2@0,1)``: how explain names a group."""
        return f"{name!r} ({self.roles.get(name, 'not a group of this rank')})"


def role_of(ranks: Sequence[int]) -> str:
    """A group's role: its size and its global ranks (in group order) relative to the first; equal for the
    groups of one mesh dimension, whichever of them a rank is in."""
    first = ranks[0]
    return f"{len(ranks)}@" + ",".join(str(r - first) for r in ranks)


def process_groups() -> Groups:
    """The process groups this rank belongs to (none without an initialised default group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return Groups({})
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    roles: dict[str, str] = {}
    for pg, name in world.pg_names.items():
        group_ranks = world.pg_group_ranks.get(pg)
        if not group_ranks:
            continue
        ranks = sorted(group_ranks, key=group_ranks.__getitem__)  # global ranks in group-rank order
        roles[str(name)] = role_of(ranks)
    return Groups(roles)


def canonical_code(code: str, groups: Groups, names: dict[str, str] | None = None, *, strict: bool = True) -> str:
    """``code`` with this rank's group names replaced by placeholders where collectives take them (recorded in
    ``names``, name -> placeholder).

    A group name is replaced where it is quoted on a line that calls a c10d op. Quoted on a
    line that calls another op, it may be a group that op uses: :class:`RankBound` rather
    than a guess. Elsewhere (an environment value ``'1'`` in inductor's repro script) it is
    a string that only looks like one, and stays. Not ``strict``: never raises (an identity).
    """
    out = []
    for line in code.splitlines(keepends=True):
        collective = "c10d" in line

        def replace(match: re.Match[str]) -> str:
            name = match.group(2)
            if name not in groups.roles:
                return match.group(0)
            if not collective:  # noqa: B023 - called within this iteration only
                if strict and "torch.ops." in line:  # noqa: B023 - called within this iteration only
                    raise RankBound(f"process group name {name!r} passed to an op other than a c10d collective")
                return match.group(0)
            placeholder = groups.placeholder(name, strict=strict)
            if names is not None:
                names[name] = placeholder
            return repr(placeholder)

        out.append(_LITERAL.sub(replace, line))
    return "".join(out)


def local_code(code: str, groups: Groups) -> str:
    """Stored ``code`` with every placeholder replaced by this rank's group of its role."""

    def replace(match: re.Match[str]) -> str:
        text = match.group(2)
        return repr(groups.local(text)) if text.startswith(PLACEHOLDER_PREFIX) else match.group(0)

    return _LITERAL.sub(replace, code)


def groups_named(text: str, groups: Groups) -> dict[str, str]:
    """This rank's groups (name -> role) that collective calls in ``text`` name (:func:`canonical_code`'s lines).

    ``text`` may be any text holding generated code, such as a pickle's bytes decoded as latin-1 (torch pickles a
    compiled graph's source as it is): the precompiled tier reads which groups a whole compiled function names.
    """
    if not groups.roles:
        return {}
    names: dict[str, str] = {}
    canonical_code(text, groups, names, strict=False)
    return {name: groups.roles[name] for name in names}


def local_groups(named: Mapping[str, str], groups: Groups) -> dict[str, str] | None:
    """For code naming the groups ``named`` (name -> role): role -> this rank's group of that role, or None where
    the code names exactly this rank's groups. :class:`RankBound` if this rank has no group, or several, of a role."""
    local = {role: groups.local(PLACEHOLDER_PREFIX + role) for role in named.values()}
    if all(local[role] == name for name, role in named.items()):
        return None
    return local


def _mesh_description(mesh: Any, groups: Groups, strict: bool) -> tuple[Any, ...]:
    """What every rank of ``mesh`` shares: device type, shape, dimension names, its dimension groups' roles."""
    dims = []
    for dim in range(mesh.ndim):
        name = str(mesh.get_group(dim).group_name)
        if name not in groups.roles:
            if strict:
                raise RankBound(f"mesh dimension {dim}'s group {name!r} is not a group of this rank")
            dims.append("?")
            continue
        dims.append(groups.placeholder(name, strict=strict))
    return ("DeviceMesh", str(mesh.device_type), tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), tuple(dims))


@dataclass(frozen=True)
class Binding:
    """A graph whose key was made rank-independent: its shared key and the group names it replaced."""

    key: str
    #: this rank's group name -> placeholder, for the names the graph uses
    names: Mapping[str, str]
    groups: Groups

    def canonical_graph(self, value: bytes) -> bytes:
        """torch's remote-cache value of the graph this process compiled (JSON around a base64 pickle of its
        own bytes) with placeholders for its group names, in the same format.

        :class:`RankBound` where a group name cannot be told from another string (:func:`canonical_code`).
        """
        wrapper = json.loads(value)
        graph = pickle.loads(base64.b64decode(wrapper["data"]))  # noqa: S301 - this process's own compile
        _rewrite(graph, lambda text: canonical_code(text, self.groups))
        data = pickle.dumps(graph)
        wrapper["data"] = base64.b64encode(data).decode("ascii")
        return json.dumps(wrapper).encode()


def rebind_graph(graph: Any, groups: Groups) -> bytes:
    """Bind a stored (verified, unpickled) compiled graph to this rank's groups, in place; its pickled bytes.

    Its python module is named by a hash of the rebound code, so ranks of different groups
    sharing one local cache directory each load their own.
    """
    _rewrite(graph, lambda text: local_code(text, groups))
    return pickle.dumps(graph)


def _rewrite(graph: Any, rewrite: Any) -> None:
    from torch._inductor.codecache import get_hash

    if not isinstance(getattr(graph, _RUNNABLE, None), str):
        raise RankBound(f"a stored graph of type {type(graph).__name__} has no source code to bind")
    for field in GRAPH_TEXT_FIELDS:
        text = getattr(graph, field, None)
        if isinstance(text, str):
            setattr(graph, field, rewrite(text))
    # the compiling rank's key details (its group names among them): torch sets a hit's own after loading it
    graph._fx_graph_cache_debug_lines = None
    graph.cache_key = get_hash(graph.source_code, "", "code")


def bind(
    gm: Any, example_inputs: Sequence[Any], fx_kwargs: Any, inputs_to_check: Sequence[int], groups: Groups | None = None
) -> Binding | None:
    """The rank-independent key of a graph that uses this rank's process groups or a device mesh; None for a
    graph that uses neither (torch's own key is rank-independent then). :class:`RankBound` if it cannot have one
    (with the graph's :attr:`RankBound.identity`)."""
    meshes = _input_meshes(example_inputs)
    groups = process_groups() if groups is None else groups
    try:
        if any(is_mesh(v) for v in vars(gm).values()):
            # torch 2.14's compile_on_one_rank: the graph reads its groups from a mesh constant at run time, and
            # a graph loaded from a cache (torch's or ours) finds that constant None (measured: 2.14.1, TP)
            raise RankBound("the graph holds a device mesh as a constant (compile_on_one_rank)")
        names: dict[str, str] = {}
        canonical = canonical_code(gm.code, groups, names)
        if not names and not meshes:
            return None
        return Binding(_key(gm, canonical, example_inputs, fx_kwargs, inputs_to_check, groups, True), names, groups)
    except RankBound as exc:
        loose = canonical_code(gm.code, groups, strict=False)
        exc.identity = _key(gm, loose, example_inputs, fx_kwargs, inputs_to_check, groups, False)
        raise


def _key(
    gm: Any,
    code: str,
    example_inputs: Sequence[Any],
    fx_kwargs: Any,
    inputs_to_check: Sequence[int],
    groups: Groups,
    strict: bool,
) -> str:
    """torch's FX key of the graph, computed from the same hash details with ``code`` for its code and every
    device mesh reduced to what its ranks share (:class:`RankBound` from a mesh, if ``strict``)."""
    from torch._inductor.codecache import FxGraphCachePickler, FxGraphHashDetails
    from torch._library.fake_class_registry import FakeScriptObject

    details = FxGraphHashDetails(gm, example_inputs, fx_kwargs, inputs_to_check)
    pickler = FxGraphCachePickler(gm, len(details.user_defined_triton_source) != 0)

    def reduce_graph_module(module: Any) -> tuple[Any, tuple[Any, ...]]:
        fn, (data, imports) = module.__reduce__()
        data["_code"] = code if module is gm else canonical_code(data["_code"], groups, strict=strict)
        return fn, (data, imports)

    original_reduce_fake = pickler.dispatch_table[FakeScriptObject]

    def reduce_fake_script_object(obj: Any) -> tuple[Any, tuple[Any, ...]]:
        if is_mesh(obj.real_obj):  # not torch's reducer: it pickles the rank's mesh and turns memoising on
            return _ident_reducer(obj.script_class_name, _mesh_description(obj.real_obj, groups, strict))
        return original_reduce_fake(obj)

    pickler.dispatch_table[gm.__class__] = reduce_graph_module
    pickler.dispatch_table[FakeScriptObject] = reduce_fake_script_object
    mesh_type = _mesh_type()
    if mesh_type is not None:  # a mesh the graph holds as a constant (2.14's compile_on_one_rank reads its groups)
        pickler.dispatch_table[mesh_type] = lambda mesh: _ident_reducer(_mesh_description(mesh, groups, strict))
    return pickler.get_key(details)


def rank_mesh_reduction(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
    """How torch's own keys (FX and AOTAutograd, each rank's) pickle a device mesh: what the compiled code depends
    on (its ranks, dimension names and groups, this rank's place in it), not the object whole. Whole, its lazily
    cached ``_hash`` (of a tuple of strings: random per process) entered the key of every graph traced after
    something hashed the mesh, so AOTAutograd's entries of those graphs missed in every later job (measured:
    2 of 4 per rank, 2.13)."""
    return _ident_reducer(
        "DeviceMesh",
        str(mesh.device_type),
        mesh.mesh.tolist(),
        tuple(mesh.mesh_dim_names or ()),
        tuple(str(mesh.get_group(d).group_name) for d in range(mesh.ndim)),
        mesh.get_rank(),
        tuple(mesh.get_coordinate() or ()),
    )


def _ident_reducer(*values: Any) -> tuple[Any, tuple[Any, ...]]:
    from torch._inductor.codecache import _ident

    return _ident, (values,)


def _mesh_type() -> type | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed
        return None
    return DeviceMesh


def is_mesh(obj: Any) -> bool:
    mesh_type = _mesh_type()
    return mesh_type is not None and isinstance(obj, mesh_type)


def _input_meshes(example_inputs: Sequence[Any]) -> list[Any]:
    """The device meshes dynamo passes to a graph as inputs (wrapped in opaque ``FakeScriptObject`` inputs)."""
    from torch._library.fake_class_registry import FakeScriptObject

    return [x.real_obj for x in example_inputs if isinstance(x, FakeScriptObject) and is_mesh(x.real_obj)]


def describe_groups(gm: Any, example_inputs: Sequence[Any], groups: Groups | None = None) -> list[str]:
    """Hash-detail lines (``[<hash>] <name>: <value>``, as torch writes its own) for what of this rank's process
    groups (``groups``, default :func:`process_groups`) and meshes a graph holds: ``process_group[0]: '3'
    (2@0,1)``, ``device_mesh[0]: rank 0, coordinate (0, 0), groups '1' '3'``. ``recipecache explain`` names
    these when two ranks' keys differ in them."""
    import hashlib

    groups = process_groups() if groups is None else groups
    lines = []
    used = sorted({m.group(2) for m in _LITERAL.finditer(gm.code) if m.group(2) in groups.roles})
    values = [("process_group", groups.describe(name)) for name in used]
    for mesh in [*_input_meshes(example_inputs), *(v for v in vars(gm).values() if is_mesh(v))]:
        names = " ".join(repr(str(mesh.get_group(d).group_name)) for d in range(mesh.ndim))
        values.append(
            ("device_mesh", f"rank {mesh.get_rank()}, coordinate {tuple(mesh.get_coordinate() or ())}, groups {names}")
        )
    counts: dict[str, int] = {}
    for kind, value in values:
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        lines.append(f"[{hashlib.sha256(value.encode()).hexdigest()[:52]}] {kind}[{index}]: {value}")
    return lines


__all__ = [
    "PLACEHOLDER_PREFIX",
    "Binding",
    "Groups",
    "RankBound",
    "bind",
    "canonical_code",
    "describe_groups",
    "groups_named",
    "is_mesh",
    "local_code",
    "local_groups",
    "process_groups",
    "rank_mesh_reduction",
    "rebind_graph",
    "role_of",
]
