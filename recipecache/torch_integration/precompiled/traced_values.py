"""The values a precompiled function depends on besides its inputs and its code: recorded, then checked.

Dynamo specialises the compiled code on values it reads (a float default argument, a global, a
module's or a class's attribute, a closure cell) and guards on them; torch reuses the code only
where the guards hold, and recompiles otherwise. Read from torch 2.13's ``_dynamo/aot_compile.py``,
``package.py`` and ``guards.py``, ``aot_compile`` artifacts lose part of that on a loader:

* guards rooted in globals are dropped by its default guard filter (``is_global``), and so are
  those torch cannot serialize (``ID_MATCH``, ``CLASS_MATCH``, ``MODULE_MATCH``, ``FUNCTION_MATCH``,
  ``CLOSURE_MATCH``...): a changed global, ``cfg.SCALE`` or ``Consts.FACTOR`` is never checked;
* a kept guard's expected value is read again at load from the pickled guard scope, where
  modules and classes are pickled by reference: ``G['cfg'].SCALE == <the loader's own value>``;
* the signature, defaults and closure cells are the producer's, pickled by value: the guard on a
  default argument or a cell checks the producer's value against itself, and the call runs it;
* the globals the bytecode reads (global tensors passed to the graph) are a copy taken at load.

So the tier records, during its own compile (:class:`Recorder`, the guard filter it hands
``aot_compile``: torch's own decisions), every guarded value that torch's loaded guards will not
compare with the producer's: each dropped guard (checked before every call, as torch's would be)
and each kept ``CONSTANT_MATCH``/``EQUALS_MATCH`` (checked when the artifact starts serving:
torch's guard then holds the traced value). A loader rebinds torch's function to its own
function's defaults and closure cells (:func:`rebind`) and serves only while every recorded value
is what the trace saw (:class:`Values`); a value torch guards by identity and that cannot be
described across processes makes the function a verdict (``unchecked_value``), never a load.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import gc
import importlib
import operator
import re
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import code_digest
from .compiled_function import Pin

#: guards whose expected value torch takes again at load (from scopes holding modules by reference)
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})
#: guards that compare identity: across processes, only a value described by more than its type stands for it
#: (``CLOSURE_MATCH`` compares a function's code, which :func:`describe` gives, and any other object's identity)
_IDENTITY_GUARDS = frozenset({"ID_MATCH", "NN_MODULE", "WEAKREF_ALIVE", "DICT_VERSION", "CLOSURE_MATCH"})
#: a global (``G['name']``) or a local (``L['name']``, or dynamo's bare ``name`` for a frame local)
_ROOT = re.compile(r"([GL])\['([^'\\]+)'\]|([A-Za-z_][A-Za-z0-9_]*)")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+)\]|\['([^'\\]*)'\]")
#: the calls dynamo writes into a guarded value's name, and what each step does: ``type(x)``, ``dict(x)``
_CALLS = {"type(": "type", "dict(": "dict"}
_ODICT_ITEM = re.compile(r", '([^'\\]*)'\)")
#: dynamo's name for a dict's item reached by the position of its key (``ConstDictKeySource``, in torch
#: 2.13 to 2.15): ``<dict>[list(dict.keys(<dict>))[N]]``
_KEY_AT = "[list(dict.keys("
_KEY_POSITION = re.compile(r"\)\)\[(\d+)\]\]")
#: dynamo's name for a dict's key at a position (``list(dict.keys(<dict>))[N]``): a key it guards (diffusers'
#: config lookups check ``name in self._internal_dict``)
_KEY = "list(dict.keys("
_KEY_INDEX = re.compile(r"\)\)\[(\d+)\]")
#: dynamo's name for the item of a dict subclass's key at a position, read past the subclass's own ``__getitem__``:
#: ``dict.__getitem__(<dict>, list(dict.keys(<dict>))[N])``
_ITEM_OF = "dict.__getitem__("
#: dynamo's name for the builtins of the traced function's globals (``__builtins_dict___0``), a global it
#: installs only while it traces: a fresh process has none, and its builtins are its own
_BUILTINS_DICT = re.compile(r"__builtins_dict___\d+")
#: a torch config entry as dynamo guards it, by its override (``<config module>._config['name'].user_override``;
#: torch 2.15's functional collectives read ``compile_on_one_rank`` so, with ``.get()``): the override is an
#: object no description stands for, so the tier pins the value the config module gives instead
_CONFIG_ENTRY = re.compile(
    r"(?P<module>.+)\._config\['(?P<name>[A-Za-z_][A-Za-z0-9_]*)'\]\.user_override(?:\.get\(\))?\Z"
)
#: dynamo's global for an imported module (``__import_torch_dot_nn``): the module's name with ``_dot_`` for dots
_IMPORT_ALIAS = re.compile(r"__import_(?P<module>[A-Za-z0-9_]+)\Z")


#: values whose description cannot change while the object lives (by value, immutable; or by qualified name)
_FIXED = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    type,
)
_MISSING = object()


def _unchanged(value: Any) -> bool:
    """Whether the same object still has the description it had: a fixed value, or a container still empty
    (torch's global hook dicts, read on every call of a module)."""
    return isinstance(value, _FIXED) or (type(value) in (dict, list, set, tuple, OrderedDict) and not value)


def describe(value: Any) -> str:
    """:func:`.code_digest.describe`, with tensors by what dynamo's tensor guard checks (not by type only),
    torch's operators by name (dynamo guards a function's ``funcol.torch.ops._c10d_functional.all_reduce`` by
    identity), DTensor placements by value, and a function defined inside another (a lambda, a closure) by its
    code too.

    dynamo guards a closure it calls by its code (``CLOSURE_MATCH``), and a qualified name does not say which
    code: ``distribute_module`` installs a lambda of each of two forms as a module's hook, both
    ``distribute_module.<locals>.<lambda>``. The code's digest does (the file's content is covered apart: by
    the torch build, or by the artifact's source digests). Placements (``Shard(dim=0)``, ``Replicate()``)
    are C++ objects, which the generic description would give by type only; dynamo guards them by equality,
    as their ``repr`` says them.
    """
    if isinstance(value, types.FunctionType) and "<" in value.__qualname__:  # ``<locals>``, ``<lambda>``
        return f"{code_digest.describe(value)}@{code_digest.of_code(value.__code__).hex()[:32]}"
    placement = _placement_type()
    if placement is not None and isinstance(value, placement):
        return f"placement:{type(value).__qualname__}:{value!r}"
    if isinstance(value, torch.Tensor):
        return (
            f"tensor:{type(value).__qualname__}:{value.dtype}:{value.device}:{tuple(value.shape)}:"
            f"{value.stride()}:{value.requires_grad}"
        )
    if isinstance(value, torch._ops.OpOverloadPacket):  # one per name in a process (``torch.ops.ns.op``)
        return f"op:{value._qualified_op_name}"
    if isinstance(value, torch._ops.OpOverload):
        return f"op:{value.name()}"
    return code_digest.describe(value)


def _placement_type() -> type | None:
    """DTensor's ``Placement``, if this process imported DTensor (a value of it can exist only then)."""
    module = sys.modules.get("torch.distributed.tensor.placement_types")
    return getattr(module, "Placement", None)


GuardPath = tuple[str, str, tuple[tuple[str, Any], ...]]


def parse(source: str) -> GuardPath | None:
    """dynamo's name of a guarded value as (scope, name, steps), or None for a form not followed here.

    ``G['cfg'].SCALE``, ``self.scale``, ``sizes[1]``, ``dict(type(self).__mro__[1].__dict__)['FACTOR']``,
    ``___odict_getitem(self._modules, 'fc1').inplace``,
    ``self._modules['up']._forward_hooks[list(dict.keys(self._modules['up']._forward_hooks))[0]]``: a global or
    local, then attributes, items, a dict's item by the position of its key (dynamo's ``ConstDictKeySource``:
    how it reaches a module's hooks, which ``parallelize_module`` installs), a dict's key by its position
    (``list(dict.keys(self._internal_dict))[0]``), a dict subclass's item by its key's position
    (``dict.__getitem__(d, list(dict.keys(d))[0])``) and the calls ``type``, ``dict`` and ``___odict_getitem``.
    """
    parsed = _expression(source, 0)
    return parsed[0] if parsed is not None and parsed[1] == len(source) else None


def _expression(text: str, at: int) -> tuple[GuardPath, int] | None:
    start = at
    head = _head(text, at)
    if head is None:
        return None
    (scope, name, steps), at = head
    while True:
        if text.startswith(_KEY_AT, at):  # ``[list(dict.keys(<the value so far>))[N]]``: the N-th key's item
            inner = _expression(text, at + len(_KEY_AT))
            position = _KEY_POSITION.match(text, inner[1]) if inner is not None else None
            if inner is None or position is None or text[at + len(_KEY_AT) : inner[1]] != text[start:at]:
                return None
            steps, at = (*steps, ("key_at", int(position.group(1)))), position.end()
            continue
        step = _STEP.match(text, at)
        if step is None:
            break
        attr, index, key = step.groups()
        steps = (
            *steps,
            ("attr", attr) if attr is not None else ("item", int(index)) if index is not None else ("item", key),
        )
        at = step.end()
    return (scope, name, steps), at


def _head(text: str, at: int) -> tuple[GuardPath, int] | None:
    """The value an expression's steps start from: a root, a call of one, a dict's key or a dict subclass's item."""
    if text.startswith(_ITEM_OF, at):
        return _item_of(text, at + len(_ITEM_OF))
    if text.startswith(_KEY, at):
        inner = _expression(text, at + len(_KEY))
        index = _KEY_INDEX.match(text, inner[1]) if inner is not None else None
        if inner is None or index is None:
            return None
        (scope, name, steps), _ = inner
        return (scope, name, (*steps, ("key", int(index.group(1))))), index.end()
    call = next((c for c in (*_CALLS, "___odict_getitem(") if text.startswith(c, at)), None)
    if call is not None:
        inner = _expression(text, at + len(call))
        if inner is None:
            return None
        (scope, name, steps), at = inner
        item = _ODICT_ITEM.match(text, at) if call == "___odict_getitem(" else None
        if item is not None:
            return (scope, name, (*steps, ("item", item.group(1)))), item.end()
        if call in _CALLS and text.startswith(")", at):
            return (scope, name, (*steps, (_CALLS[call], None))), at + 1
        return None
    root = _ROOT.match(text, at)
    if root is None:
        return None
    scope, name = (root.group(1), root.group(2)) if root.group(1) else ("L", root.group(3))
    return (scope, name, ()), root.end()


def _item_of(text: str, at: int) -> tuple[GuardPath, int] | None:
    """``dict.__getitem__(<dict>, list(dict.keys(<dict>))[N])`` from past its opening: the N-th key's item of that
    dict, read past a subclass's own ``__getitem__``."""
    mapping = _expression(text, at)
    if mapping is None or not text.startswith(", ", mapping[1]):
        return None
    key = _expression(text, mapping[1] + 2)
    if key is None or not key[0][2] or not text.startswith(")", key[1]):
        return None
    last = key[0][2][-1]
    (scope, name, steps), _ = mapping
    if last[0] != "key" or key[0] != (scope, name, (*steps, last)):
        return None  # not a key of this dict
    return (scope, name, (*steps, ("dict_key_at", last[1]))), key[1] + 1


def reader(steps: tuple[tuple[str, Any], ...]) -> tuple[Callable[[Any], Any], ...]:
    """``steps`` of a :class:`GuardPath` as one callable each (made once per pin, applied on every call)."""
    return tuple(_step(kind, arg) for kind, arg in steps)


def _step(kind: str, arg: Any) -> Callable[[Any], Any]:
    if kind == "attr":
        return operator.attrgetter(arg)
    if kind == "item":
        return operator.itemgetter(arg)
    if kind in _BY_POSITION:
        return functools.partial(_BY_POSITION[kind], arg)
    return type if kind == "type" else dict


def _key_at(position: int, mapping: Any) -> Any:
    """``mapping``'s key at ``position``, as dynamo reads it (``dict.keys``: insertion order)."""
    return list(dict.keys(mapping))[position]


def _item_at(position: int, mapping: Any) -> Any:
    """The item of ``mapping``'s key at ``position``."""
    return mapping[_key_at(position, mapping)]


def _dict_item_at(position: int, mapping: Any) -> Any:
    """:func:`_item_at` past a dict subclass's own ``__getitem__``, as dynamo reads it (``dict.__getitem__``)."""
    return dict.__getitem__(mapping, _key_at(position, mapping))


#: the steps that read a dict by a key's position: its item (``key_at``), the key itself, its item past a
#: subclass's ``__getitem__`` (``dict_key_at``)
_BY_POSITION: dict[str, Callable[[int, Any], Any]] = {"key_at": _item_at, "key": _key_at, "dict_key_at": _dict_item_at}


class Recorder:
    """The guard filter the tier hands ``aot_compile``: torch's default decisions, recording what they leave out."""

    def __init__(self) -> None:
        self.pins: list[Pin] = []
        #: guarded values no description can stand for across processes (a verdict when any)
        self.unchecked: list[str] = []

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        from torch._dynamo.guards import CheckFunctionManager

        keep = []
        unsupported = frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
        for entry in entries:
            # as torch's ``serialize_guards`` judges: a guard whose checks include one it cannot write (a
            # ``CONSTANT_MATCH`` on a code object is an ``ID_MATCH``: diffusers' attention processor) fails the save
            kept = not (entry.is_global or {entry.guard_type, *(entry.derived_guard_types or ())} & unsupported)
            keep.append(kept)
            self._record(entry, kept)
        return keep

    def _record(self, entry: Any, kept: bool) -> None:
        types_ = {entry.guard_type, *(entry.derived_guard_types or ())}
        if not entry.name or (kept and not types_ & _VALUE_GUARDS):
            return  # ambient state, or a guard torch checks against the value it pickled
        config = _CONFIG_ENTRY.match(entry.name)
        if config is not None:
            self._pin_config(entry.name, f"{config['module']}.{config['name']}")
            return
        if not entry.has_value or parse(entry.name) is None:
            self.unchecked.append(entry.name)
            return
        value = describe(entry.value)
        if types_ & _IDENTITY_GUARDS and value.startswith(("object:", "unreadable:")):
            self.unchecked.append(entry.name)
            return
        self.pins.append(Pin(entry.name, value, per_call=not kept))

    def _pin_config(self, guarded: str, source: str) -> None:
        """Pin the value of the config entry whose override ``guarded`` names, read as ``source`` (checked on every
        call: a config set later changes what the normal path would compile); unchecked if it cannot be read."""
        if any(pin.source == source for pin in self.pins):
            return
        path = parse(source)
        try:
            if path is None or path[0] != "G":
                raise LookupError(source)
            value = _imported(path[1])
            for step in reader(path[2]):
                value = step(value)
        except Exception:  # noqa: BLE001 - whatever hides the value, the guard stays unchecked
            self.unchecked.append(guarded)
            return
        self.pins.append(Pin(source, describe(value), per_call=True))


def _imported(alias: str) -> Any:
    """The module dynamo's global ``alias`` (``__import_torch_dot_nn``) stands for; LookupError for another name."""
    found = _IMPORT_ALIAS.match(alias)
    if found is None:
        raise LookupError(alias)
    return _module(found["module"].replace("_dot_", "."))


def _module(name: str) -> Any:
    """The module ``name``, imported if this process has not yet."""
    return sys.modules.get(name) or importlib.import_module(name)


@dataclasses.dataclass
class Values:
    """The pins of one loaded function, checked in this process (its globals, torch's import aliases, its locals)."""

    pins: tuple[Pin, ...]
    globals: dict[str, Any]
    #: dynamo's aliases of imported modules (``__import_torch_dot_nn``), which the module's globals may lack
    aliases: dict[str, str]
    #: the names of the globals torch's function reads, in its copy of the globals taken at load
    bytecode_globals: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        #: per pin, where its value is read (scope and name, None for a form not followed) and the steps from there
        checks = []
        for pin in self.pins:
            path = parse(pin.source)
            checks.append((pin, None if path is None else path[:2], () if path is None else reader(path[2])))
        self._every = tuple(checks)
        self._per_call = tuple(c for c in checks if c[0].per_call)
        #: per pin, the object last found equal to the traced value, and whether it is of a fixed type (else an
        #: empty container, equal while still empty): its description cannot have changed
        self._same: dict[int, tuple[Any, bool]] = {}
        #: values described to compare with a pin (the identity shortcut left out), for tests
        self.described = 0

    def changed(self, f_locals: Callable[[], dict[str, Any]], *, every: bool) -> str | None:
        """The first pin (all of them, or ``every=False``: those torch does not check) that differs now, or None.

        ``f_locals`` gives the call's locals as torch's guards see them; called only for a pin rooted there.
        Every pin is read again on every call (a global may be rebound at any time); one still holding the
        object found equal before, whose description cannot have changed, is not described again.
        """
        bound: dict[str, Any] | None = None
        for pin, root, steps in self._every if every else self._per_call:
            try:
                if root is None:
                    value = _MISSING
                elif root[0] == "G":
                    value = self.globals.get(root[1], _MISSING)
                    if value is _MISSING:
                        value = self._global(root[1])
                else:
                    if bound is None:
                        bound = f_locals()
                    value = bound[root[1]]
                for step in steps:
                    value = step(value)
            except Exception:  # noqa: BLE001 - a value this process no longer has differs
                value = _MISSING
            same = self._same.get(id(pin))
            if same is not None and same[0] is value and (same[1] or not value):
                continue
            self.described += 1
            now = None if value is _MISSING else describe(value)
            if now != pin.value:
                return f"{pin.source} is {now or 'missing'}, traced as {pin.value}"
            if _unchanged(value):
                self._same[id(pin)] = (value, isinstance(value, _FIXED))
        return None

    def _global(self, name: str) -> Any:
        if name in self.globals:
            return self.globals[name]
        if _BUILTINS_DICT.fullmatch(name):  # as torch's get_builtins_dict: a module's, or the dict itself
            found = self.globals.get("__builtins__", builtins)
            return found if isinstance(found, dict) else found.__dict__
        module = self.aliases.get(name)
        # a pin on a torch config entry names the module by dynamo's alias alone
        return _imported(name) if module is None else _module(module)

    def refresh(self, fn: Any) -> None:
        """Point torch's copy of the globals at this process's current ones (a global tensor rebound since load)."""
        copy = fn.fn.__globals__
        for name in self.bytecode_globals:
            copy[name] = self.globals[name]


def values_of(fn: Any, pins: Sequence[Pin], f_globals: dict[str, Any]) -> Values:
    """:class:`Values` for torch's ``AOTCompiledFunction`` ``fn`` running in ``f_globals``."""
    env = fn._artifacts.runtime_env
    read = tuple(name for name in env.used_globals if name in f_globals)
    return Values(tuple(pins), f_globals, dict(env.import_sources), read)


def rebind(fn: Any, function: types.FunctionType) -> None:
    """Make torch's loaded function bind this process's defaults and closure cells, not the producer's copies.

    Its guards then check them on every call (their expected values are the traced ones), and
    the compiled code runs with them, as the normal path would.
    """
    from torch._dynamo.convert_frame import _get_signature

    artifacts = fn._artifacts
    artifacts.signature = _get_signature(function)
    artifacts.runtime_env = dataclasses.replace(
        artifacts.runtime_env,
        closure=function.__closure__,
        argdefs=function.__defaults__,
        kwdefaults=function.__kwdefaults__,
    )
    compiled = fn.fn
    fn.fn = types.FunctionType(
        compiled.__code__, compiled.__globals__, compiled.__name__, function.__defaults__, function.__closure__
    )
    fn.fn.__kwdefaults__ = function.__kwdefaults__


#: dynamo's global for a module its generated bytecode loads (``codegen.create_load_python_module``), named by the
#: producer's object id: ``___module_collections_140407316877200_c0``
_MODULE_GLOBAL = "___module_"


def modules_installed(fn: Any, scope: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(global name, module name) of each module global dynamo installed in ``scope`` that ``fn``'s bytecode reads.

    dynamo installs them in the traced function's globals while it compiles, so a fresh process's
    globals lack them (the name holds the producer's ``id``) and torch refuses the load ("Missing
    required external references"): diffusers' UNet, whose output rebuilds an ``OrderedDict`` subclass.
    """
    refs = fn._artifacts.runtime_env.external_refs
    return tuple(
        sorted(
            (name, value.__name__)
            for name in refs
            if name.startswith(_MODULE_GLOBAL) and isinstance(value := scope.get(name), types.ModuleType)
        )
    )


#: dynamo's global for the globals of an inlined function that belong to no module (a namedtuple's ``__new__``,
#: which ``collections.namedtuple`` makes by ``eval`` in a namespace of its own), named by the producer's object id:
#: ``___unnamed_scope_139983857262592_c0``
_UNNAMED_SCOPE_GLOBAL = "___unnamed_scope_"


def scopes_installed(scope: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(global name, ``<module>:<class qualname>.<function name>``) of each unnamed scope dynamo installed in
    ``scope``, named by the function a class holds whose globals it is.

    torch_geometric's generated ``propagate`` builds a namedtuple: dynamo guards the namespace of its ``__new__``
    under a name no other process has, so the value pin rooted there refused every load elsewhere
    (``value_changed``) and a fresh job compiled again. A scope whose owner is not found is left out: its pin
    refuses the load, counted, as before.
    """
    return tuple(
        sorted(
            (name, owner)
            for name, value in list(scope.items())
            if name.startswith(_UNNAMED_SCOPE_GLOBAL)
            and isinstance(value, dict)
            and (owner := _owner_of_globals(value)) is not None
        )
    )


def _owner_of_globals(namespace: dict[str, Any]) -> str | None:
    """``<module>:<qualname>.<name>`` of a function whose ``__globals__`` is ``namespace`` and which its class holds,
    found through the garbage collector's referrers (at build time only) and checked to resolve back to it."""
    for function in gc.get_referrers(namespace):
        if not isinstance(function, types.FunctionType) or function.__globals__ is not namespace:
            continue
        # the class holds it in its dict, or through a staticmethod there (a class's ``__new__`` becomes one)
        name: str = function.__name__
        level: list[Any] = [function]
        for _ in range(3):
            level = [outer for inner in level for outer in gc.get_referrers(inner)]
            for cls in level:
                if isinstance(cls, type) and getattr(cls, name, None) is function:
                    owner = f"{cls.__module__}:{cls.__qualname__}.{name}"
                    try:
                        if _globals_of(owner) is namespace:
                            return owner
                    except (ImportError, AttributeError):
                        continue
    return None


def _globals_of(owner: str) -> Any:
    """The ``__globals__`` of the function ``owner`` names (:func:`_owner_of_globals`); raises ImportError or
    AttributeError where this process has no such function."""
    module, _, path = owner.partition(":")
    found: Any = _module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found.__globals__


def install_scopes(scopes: Sequence[tuple[str, str]], scope: dict[str, Any]) -> None:
    """Bind each of an artifact's unnamed scopes in ``scope`` to this process's namespace of the same function, as
    dynamo did in the producer; ImportError or AttributeError where this process has no such function, ValueError
    for a name bound to another value."""
    for name, owner in scopes:
        namespace = _globals_of(owner)
        if scope.setdefault(name, namespace) is not namespace:
            raise ValueError(f"{name} is bound to another value than the globals of {owner} here")


def install_modules(modules: Sequence[tuple[str, str]], scope: dict[str, Any]) -> None:
    """Bind each of an artifact's module globals in ``scope`` (the traced function's globals), as dynamo did in the
    producer; ImportError for a module this process cannot import, ValueError for a name bound to another value."""
    for name, module_name in modules:
        module = _module(module_name)
        if scope.setdefault(name, module) is not module:
            raise ValueError(f"{name} is bound to another value than module {module_name} here")
