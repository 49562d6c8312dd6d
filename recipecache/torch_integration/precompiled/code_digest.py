"""What this process runs from a source file: a digest of its code objects and of the globals they name.

A precompiled artifact's bytecode and kernels were derived from the functions dynamo
traced in its producer, and ``aot_compile`` drops the guards on globals (their values are
baked into the graph). A loader must therefore run it only where the same code, with the
same globals, would run. The file on disk does not say that: a long job imported its
modules when it started, the shared checkout may have been edited since, and another job
may then have published the new version. So a traced file is described by what this
process holds from it:

* every code object of the modules loaded from that path (``sys.modules`` entries whose
  ``__file__`` it is): functions, methods, properties, decorated functions, and nested
  functions and lambdas through their parent's constants; each with its bytecode,
  constants, names, argument layout and line table (the bytecode is the unspecialised
  ``co_code``, stable within one Python version, which is in the key);
* the values that the globals the traced code reads (``LOAD_GLOBAL``; their names are
  recorded in the artifact) hold now in those modules: plain values (numbers, strings,
  containers of them, dataclasses, torch dtypes and devices) by value; functions,
  classes and modules by qualified name; other objects by type only (their state is
  often per process, a logger's level say). Only the traced code's globals: a global that
  other code of the file changes at run time (a counter, a cache) must not make every
  artifact a miss.

Two processes that imported the same source (and set the same globals) get the same
digest; any change of what a process runs changes it, whatever the disk holds. A module
generated at run time into the temporary directory (torch_geometric renders each
``MessagePassing``'s ``propagate`` into ``$TMPDIR/<module>_<random>.py``) is named by its module,
``module:<name>``, not by a path no other process has: the module of that name in the
loading process is digested instead, from whatever file it was generated into. A file
this process holds no module of yet is imported by the name it loads under (a model's lazy
import, which the call checked would make); one that still has none has no digest: an
artifact naming it is not loaded. This
module does not import torch.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
from collections.abc import Iterable
from typing import Any

from .compiled_function import SourceFile

log = logging.getLogger(__name__)

#: containers longer than this, or nested deeper, are described by type and length only
_MAX_ITEMS = 256
_MAX_DEPTH = 4
#: value types of torch's whose repr is their value (a dtype global is baked into a graph)
_TORCH_VALUE_TYPES = frozenset({"dtype", "device", "layout", "memory_format", "qscheme"})
#: what stands for a file this process holds no code of
MISSING = bytes(32)


def of_traced(codes: Iterable[types.CodeType]) -> tuple[SourceFile, ...]:
    """The files of the code objects dynamo traced, each with the digest of what this process runs from it.

    The traced code objects count even where the module namespace does not reach them
    (a function kept only in a dict, say), so the digest covers all the artifact runs.
    """
    by_file: dict[str, list[types.CodeType]] = {}
    for code in codes:
        by_file.setdefault(code.co_filename, []).append(code)
    namespaces = _namespaces(by_file)
    out = []
    for path in sorted(by_file):
        names = tuple(sorted({name for code in by_file[path] for c in _nested(code) for name in _globals_read(c)}))
        digest = _digest(path, namespaces.get(path, []), names, by_file[path])
        out.append(SourceFile(_generated_name(path) or path, digest, names))
    return tuple(out)


#: how a module generated into the temporary directory is named among an artifact's sources
GENERATED = "module:"


def _generated_name(path: str) -> str | None:
    """``module:<name>`` for a file in this process's temporary directory that a loaded module was generated into
    under a file name of its own (not ``<name>.py``: a temporary file's), else None: that path is this process's
    alone. A module or script that merely lives there keeps its path (the script under any of its names)."""
    if not path.startswith(os.path.join(tempfile.gettempdir(), "")):
        return None
    script = sys.modules.get("__main__")  # also ``__mp_main__`` once multiprocessing started a child
    names = sorted(
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None) == path and module is not script and not _where_imports_put(name, path)
    )
    return f"{GENERATED}{names[0]}" if names else None


def _where_imports_put(name: str, path: str) -> bool:
    """Whether ``path`` is where an import of module ``name`` finds it: ``<last part>.py`` (or an extension module's
    ``<last part>.<tags>.so``), or a package's ``<last part>/__init__.py`` (a checkout in the temporary directory)."""
    last = name.rpartition(".")[2]
    folder, file = os.path.split(path)
    stem = file.partition(".")[0]
    return stem == last or (stem == "__init__" and os.path.basename(folder) == last)


def _current_generated(source: SourceFile) -> SourceFile:
    """The digest of the module ``source`` names (``module:<name>``), from the file this process generated it into."""
    module = sys.modules.get(source.path[len(GENERATED) :])
    path = getattr(module, "__file__", None)
    if module is None or not isinstance(path, str):
        return SourceFile(source.path, MISSING, source.names)
    return SourceFile(source.path, _digest(path, [vars(module)], source.names, ()), source.names)


def current(sources: Iterable[SourceFile]) -> tuple[SourceFile, ...]:
    """``sources`` (an artifact's) with the digests of what this process runs from their files.

    A file no loaded module holds yet is imported first (:func:`_import_file`): a model that imports
    lazily (``import x`` in a function body, a package's module ``__getattr__``) loads it at the call
    this check precedes, and without the import every fresh process saw no code there and fell back
    (``source_changed``, issue 44 item 5).
    """
    sources = list(sources)
    files = [s.path for s in sources if not s.path.startswith(GENERATED)]
    namespaces = _namespaces(files)
    missing = [path for path in files if path not in namespaces]
    if missing:
        for path in missing:
            _import_file(path)
        namespaces = _namespaces(files)
    return tuple(
        _current_generated(s)
        if s.path.startswith(GENERATED)
        else SourceFile(s.path, _digest(s.path, namespaces.get(s.path, []), s.names, ()), s.names)
        for s in sources
    )


def stale(sources: Iterable[SourceFile]) -> list[str]:
    """The paths among ``sources`` whose code in this process differs from the recorded digest (or is absent)."""
    sources = list(sources)
    ours = current(sources)
    return [s.path for s, mine in zip(sources, ours, strict=True) if mine.digest == MISSING or mine.digest != s.digest]


def _import_file(path: str) -> None:
    """Import the module this process's import system loads from ``path``, if one does.

    Its name is found from ``sys.path`` (the entry ``path`` lies under, packages as dotted parts)
    and taken only when ``importlib.util.find_spec`` resolves it to that very file and no module of
    that name is loaded yet (one loaded from another file is other code: the digest stays MISSING).
    The module's own import runs, as the program's call would run it; what it then holds is
    digested, so code edited since the artifact was built still differs. A module that fails to
    import is left out (its file keeps no digest, the artifact is not loaded).
    """
    for entry in sys.path:
        root = os.path.abspath(entry or os.curdir)
        if not path.startswith(root + os.sep) or not path.endswith(".py"):
            continue
        parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if not parts or not all(part.isidentifier() for part in parts) or name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None or os.path.realpath(spec.origin) != os.path.realpath(path):
                continue
            importlib.import_module(name)
        except Exception:  # the user's module fails to import: no code of it runs here
            log.debug("recipecache: %s (%s) does not import", name, path, exc_info=True)
        return


def _namespaces(paths: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """The globals of every loaded module whose file is one of ``paths`` (a script may be loaded twice)."""
    wanted = set(paths)
    found: dict[str, list[dict[str, Any]]] = {}
    for module in list(sys.modules.values()):
        try:
            path = getattr(module, "__file__", None)
            if path in wanted:
                found.setdefault(path, []).append(vars(module))
        except Exception:  # noqa: BLE001 - a lazy or proxy module that fails on access holds nothing of ours
            continue
    return found


def _digest(
    path: str, namespaces: list[dict[str, Any]], names: Iterable[str], roots: Iterable[types.CodeType]
) -> bytes:
    """The digest of ``path``'s code in ``namespaces`` (plus ``roots``) and of its globals ``names``; or MISSING."""
    codes: dict[int, types.CodeType] = {}
    for namespace in namespaces:
        _reachable_code(list(namespace.values()), path, codes)
    covered = {id(c) for code in codes.values() for c in _nested(code)}
    codes.update((id(c), c) for c in roots if id(c) not in covered)
    if not namespaces and not codes:
        return MISSING
    h = hashlib.sha256()
    for part in sorted(of_code(code) for code in codes.values()):
        _feed(h, part)
    for name in sorted(set(names)):
        values = sorted(describe(namespace[name]) for namespace in namespaces if name in namespace)
        _feed(h, f"{name}={values}".encode())  # [] for a builtin
    return h.digest()


def _globals_read(code: types.CodeType) -> Iterable[str]:
    """The global names ``code`` itself reads (not its attribute names, which ``co_names`` holds too)."""
    return (str(ins.argval) for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))


def _reachable_code(stack: list[Any], path: str, out: dict[int, types.CodeType]) -> None:
    """The code objects from ``path`` that the objects in ``stack`` hold (functions, classes and their members)."""
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if isinstance(obj, types.FunctionType):
                if obj.__code__.co_filename == path:
                    out[id(obj.__code__)] = obj.__code__
                wrapped = vars(obj).get("__wrapped__")  # functools.wraps: the decorated function
                if wrapped is not None:
                    stack.append(wrapped)
            elif isinstance(obj, type):
                stack.extend(vars(obj).values())
            elif isinstance(obj, (staticmethod, classmethod)):
                stack.append(obj.__func__)
            elif isinstance(obj, property):
                stack.extend((obj.fget, obj.fset, obj.fdel))
            elif isinstance(obj, functools.partial):
                stack.append(obj.func)
        except Exception:  # noqa: BLE001 - an object that fails on inspection holds no code we can see
            continue


def _nested(code: types.CodeType) -> Iterable[types.CodeType]:
    """``code`` and the code objects of the functions, lambdas and classes defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def of_code(code: types.CodeType) -> bytes:
    """What ``code`` runs (bytecode, constants, names, argument layout, line table; its nested code too)."""
    h = hashlib.sha256()
    layout = (
        getattr(code, "co_qualname", code.co_name),
        code.co_firstlineno,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
    )
    _feed(h, repr(layout).encode())
    for part in (code.co_code, code.co_linetable, getattr(code, "co_exceptiontable", b"")):
        _feed(h, part)
    for const in code.co_consts:
        _feed(h, of_code(const) if isinstance(const, types.CodeType) else _value(const).encode())
    return h.digest()


def _feed(h: Any, part: bytes) -> None:
    h.update(len(part).to_bytes(8, "little"))
    h.update(part)


def describe(value: Any) -> str:
    """:func:`_value`, or the type of a value that fails to describe itself (a broken ``__repr__``, say)."""
    try:
        return _value(value)
    except Exception:  # noqa: BLE001 - described as well as it can be; equal values still compare equal
        return f"unreadable:{type(value).__module__}.{type(value).__qualname__}"


def _value(value: Any, depth: int = 0) -> str:
    """A description of ``value`` that is equal in two processes holding equal values (sets and dicts sorted)."""
    kind = type(value)
    if value is None or value is Ellipsis or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum)):
        return f"{kind.__qualname__}:{value!r}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{kind.__name__}:{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None)}"
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, types.CodeType):  # dynamo guards a method's code by identity (``type(m).__call__.__code__``)
        return f"code:{getattr(value, 'co_qualname', value.co_name)}@{of_code(value).hex()[:32]}"
    if isinstance(value, (tuple, list, set, frozenset, dict)):
        if depth >= _MAX_DEPTH or len(value) > _MAX_ITEMS:
            return f"{kind.__qualname__}[{len(value)}]"
        if isinstance(value, dict):
            items = sorted(f"{_value(k, depth + 1)}: {_value(v, depth + 1)}" for k, v in list(value.items()))
        elif isinstance(value, (set, frozenset)):
            items = sorted(_value(v, depth + 1) for v in list(value))
        else:
            items = [_value(v, depth + 1) for v in value]
        return f"{kind.__qualname__}({', '.join(items)})"
    if dataclasses.is_dataclass(value) and depth < _MAX_DEPTH:
        fields = (f"{f.name}={_value(getattr(value, f.name, None), depth + 1)}" for f in dataclasses.fields(value))
        return f"{kind.__module__}.{kind.__qualname__}({', '.join(fields)})"
    if kind.__module__ == "torch" and kind.__name__ in _TORCH_VALUE_TYPES:
        return f"torch:{value!r}"
    return f"object:{kind.__module__}.{kind.__qualname__}"
