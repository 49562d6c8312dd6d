"""Every name the docs give of this repository exists: a renamed module, class or function fails here, not in a
new maintainer's search (issue 45: the docs named no-stall's files and classes two renames late).

What counts as a reference to this repository, in the prose's code spans (and, for the first two kinds, in its
code blocks too):

* a path under one of the repository's folders (``recipecache/store.py``, ``tests/conftest.py``, a glob such as
  ``tests/deploy/test_deploy_*.py``, ``file.py::test_name``): the file exists (and defines the test), or is one a
  ``.gitignore`` leaves to the user to make (``deploy/secrets/redis_password``);
* a name under ``recipecache.`` or ``launcher.`` (``recipecache.runs.explain.analyse``, ``recipecache.enable()``):
  the module exists and defines each attribute;
* a relative file name (``no_stall/controller.py``, ``entries.py``): a file of the repository ends with it, unless
  it names one of torch's files (``_inductor/compile_fx.py``);
* a module's attribute (``events.read_events``, ``runs.keyinfo.load_keys()``, ``store.stats()`` on the
  module's class), where the module is one of the repository's and neither torch nor another installed library
  has a module of its name (``redis.conf`` is a file, ``redis.Redis`` redis-py's);
* a class's attribute (``StoreAdmin.open``, ``Backend.health_checks``), where the class is one of the repository's.

Names are looked up in the source (``ast``), never imported: the docs name modules that import torch. Torch's
names (``torch._dynamo.config``, ``FxGraphCache.prepare_key``) and a bare class name (``Store``) are out of scope:
nothing tells a bare name of this repository from one of torch's or another library's.

``docs/history/`` is left out, on purpose: it records research and measurements as they were written (issue 45),
naming modules and functions since renamed or removed, and is not maintained; a name in it is true of its day.
Every other document is the reference of what is true today, and is checked.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.paths import REPO

#: the documents a maintainer reads (``docs/history/`` not among them: see the module docstring)
DOCS = sorted(
    [*(REPO / "docs").glob("*.md"), REPO / "README.md", REPO / "corpus" / "README.md", *(REPO / "deploy").rglob("*.md")]
)
#: folders whose paths the docs give from the repository's root
ROOTS = ("recipecache", "launcher", "benchmarks", "tests", "corpus", "deploy", "examples", "scripts", "docs")
#: folders of Python modules, each with the folder its imports start from
IMPORT_ROOTS = {
    "recipecache": REPO,
    "launcher": REPO,
    "benchmarks": REPO / "benchmarks",
    "tests": REPO / "tests",
    "corpus": REPO / "corpus",
    "examples": REPO / "examples",
}

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(rf"(?<![\w/.~-])((?:{'|'.join(ROOTS)})/[\w./*{{}},-]*)")
QUALIFIED = re.compile(r"(?<![\w.])((?:recipecache|launcher)(?:\.[A-Za-z_]\w*)+)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
RELATIVE_FILE = re.compile(r"[\w/]+\.py")


def references(text: str) -> Iterator[tuple[str, str]]:
    """(kind, name) of every reference to this repository in a document's text."""
    for block in FENCE.findall(text):
        yield from (("path", m) for m in REPO_PATH.findall(block))
        yield from (("qualified", m) for m in QUALIFIED.findall(block))
    for span in SPAN.findall(FENCE.sub("", text)):
        if not span.strip():
            continue
        paths = REPO_PATH.findall(span)
        yield from (("path", m) for m in paths)
        first = span.split()[0]
        name = first.split("(")[0].rstrip(".,:;")
        if QUALIFIED.fullmatch(name):
            yield "qualified", name
        elif not paths and RELATIVE_FILE.fullmatch(first.split("::")[0].split(":")[0]):
            yield "file", first
        elif DOTTED.fullmatch(name):
            yield "dotted", name


# --- the repository's files and what they define ------------------------------------------------------------


@functools.cache
def python_files() -> list[Path]:
    return [p for root in IMPORT_ROOTS for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts]


@functools.cache
def repo_files() -> tuple[str, ...]:
    """The repository's Python files, relative to its root."""
    return tuple(str(p.relative_to(REPO)) for p in REPO.rglob("*.py") if ".git" not in p.parts)


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a body, those under ``if``/``try`` (``TYPE_CHECKING`` imports, fallbacks) included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _targets(node: ast.stmt) -> Iterator[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    for target in targets:
        for leaf in ast.walk(target):
            if isinstance(leaf, ast.Name):
                yield leaf.id


@functools.cache
def module_names(path: Path) -> frozenset[str]:
    """The names a module defines: functions, classes, assignments, imports, and a lazy ``__getattr__``'s names
    (the string keys of its module-level tables)."""
    names: set[str] = set()
    for node in _top_level(tree(path).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        names.update(_targets(node))
    if "__getattr__" in names:
        for node in _top_level(tree(path).body):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                names.update(
                    k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                )
    return frozenset(names)


@functools.cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of the repository by name (several modules may define one of a name)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for path in python_files():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
    return found


def class_names(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
    """A class's attributes: its body's, those its methods set on ``self``, and its bases' of this repository."""
    names: set[str] = set()
    for item in _top_level(node.body):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        names.update(_targets(item))
    for leaf in ast.walk(node):
        if (
            isinstance(leaf, ast.Attribute)
            and isinstance(leaf.value, ast.Name)
            and leaf.value.id == "self"
            and isinstance(leaf.ctx, ast.Store)
        ):
            names.add(leaf.attr)
    for base in node.bases:
        base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        if base_name and base_name not in seen:
            for base_node in classes().get(base_name, []):
                names |= class_names(base_node, seen | {node.name})
    return names


def class_has(class_name: str, chain: list[str]) -> bool:
    """Whether some class of the name has the first attribute of ``chain``, and where that is a class of the
    repository, that class the rest (an attribute of a method, ``fn.cache_clear``, is not followed)."""
    for node in classes().get(class_name, []):
        if not chain:
            return True
        if chain[0] in class_names(node) and (
            len(chain) == 1 or chain[0] not in classes() or class_has(chain[0], chain[1:])
        ):
            return True
    return False


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the repository by its import name (``recipecache.runs.events``, ``harness.ports``)."""
    found = {}
    for path in python_files():
        root = next(base for folder, base in IMPORT_ROOTS.items() if path.is_relative_to(REPO / folder))
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def attributes_resolve(path: Path, chain: list[str]) -> bool:
    """Whether a module defines ``chain[0]`` and, where that is a class of the repository, the class the rest;
    or (an instance named after its module: ``store.stats()``) a class of the module defines ``chain[0]``."""
    if not chain:
        return True
    if chain[0] in module_names(path):
        return len(chain) == 1 or chain[0] not in classes() or class_has(chain[0], chain[1:])
    own_classes = [n.name for n in tree(path).body if isinstance(n, ast.ClassDef)]
    return any(class_has(name, chain) for name in own_classes)


def qualified_resolves(name: str, *, suffix: bool = False) -> bool:
    """Whether the longest module prefix of ``name`` (any module ending with it, with ``suffix``) defines the rest."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        found = [p for m, p in modules().items() if m == prefix or (suffix and m.endswith("." + prefix))]
        if found:
            return any(attributes_resolve(path, parts[cut:]) for path in found)
    return False


@functools.cache
def module_stems() -> frozenset[str]:
    """The last part of every module's name: how the docs name a module in passing (``events``, ``runs``)."""
    return frozenset(m.split(".")[-1] for m in modules())


# --- torch's names, which the docs give beside ours -------------------------------------------------------------


@functools.cache
def torch_files() -> tuple[str, ...]:
    """torch's module files, relative to its package (found without importing it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch is not installed: the docs' torch names cannot be told from stale names of ours")
    root = Path(next(iter(spec.submodule_search_locations)))
    return tuple(str(p.relative_to(root)) for p in root.rglob("*.py"))


@functools.cache
def torch_module_stems() -> frozenset[str]:
    return frozenset(Path(f).stem if Path(f).stem != "__init__" else Path(f).parent.name for f in torch_files())


@functools.cache
def another_library(name: str) -> bool:
    """Whether ``name`` is a top-level module installed from outside the repository (``redis``, ``os``)."""
    spec = importlib.util.find_spec(name)
    return (
        spec is not None
        and not str(spec.origin or "").startswith(str(REPO))
        and not any(str(location).startswith(str(REPO)) for location in spec.submodule_search_locations or ())
    )


# --- the checks --------------------------------------------------------------------------------------------------


def stale(kind: str, name: str) -> bool:
    """Whether a reference of ``kind`` (what :func:`references` yields) names nothing of this repository, where it
    is one of this repository's at all (the module docstring says when)."""
    if kind == "path":
        return path_is_stale(name)
    if kind == "qualified":
        return not qualified_resolves(name)
    if kind == "file":
        relative = name.split("::")[0].split(":")[0]
        return not any(f == relative or f.endswith("/" + relative) for f in (*repo_files(), *torch_files()))
    first = name.split(".")[0]
    if another_library(first):
        return False
    if first in classes():
        return not class_has(first, name.split(".")[1:])
    if first in module_stems() and first not in torch_module_stems():
        return not qualified_resolves(name, suffix=True)
    return False


def path_is_stale(name: str) -> bool:
    """Whether a path from the repository's root (with a ``{a,b}`` choice, a glob, a ``:line`` or a ``::test``)
    names no file, or a test its file does not define."""
    path, _, test = name.rstrip(".,:;)").partition("::")
    path = path.split(":")[0]
    alternatives = [path]
    brace = re.search(r"\{([^{}]*)\}", path)
    if brace:
        alternatives = [path[: brace.start()] + choice + path[brace.end() :] for choice in brace.group(1).split(",")]
    for candidate in alternatives:
        exists = any(REPO.glob(candidate)) if "*" in candidate else (REPO / candidate).exists()
        if not exists and not made_by_the_user(REPO / candidate):
            return True
    if test:
        file = REPO / path
        return test.split("[")[0] not in module_names(file)
    return False


def made_by_the_user(path: Path) -> bool:
    """Whether ``path`` is a file the repository keeps out of git for its user to make (``deploy/secrets/``'s
    passwords): the nearest ``.gitignore`` above it decides, its last matching pattern winning."""
    for folder in path.parents:
        if folder == REPO.parent:
            return False
        if (folder / ".gitignore").is_file():
            ignored = False
            for pattern in (folder / ".gitignore").read_text().splitlines():
                negated, glob = pattern.startswith("!"), pattern.lstrip("!")
                if glob and not glob.startswith("#") and fnmatch.fnmatch(str(path.relative_to(folder)), glob):
                    ignored = not negated
            return ignored
    return False


@functools.cache
def doc_references() -> dict[str, set[tuple[str, str]]]:
    return {str(doc.relative_to(REPO)): set(references(doc.read_text())) for doc in DOCS}


def test_the_docs_name_only_what_exists() -> None:
    found = [
        f"{doc}: {name} ({kind})"
        for doc, refs in doc_references().items()
        for kind, name in sorted(refs)
        if stale(kind, name)
    ]
    assert not found, "names the docs give that do not exist:\n" + "\n".join(found)


def test_the_reference_is_checked_and_the_history_is_not() -> None:
    """The torch integration's reference is read; docs/history/, which names what is gone, is not (docstring)."""
    checked = {str(doc.relative_to(REPO)) for doc in DOCS}
    assert "docs/torch-integration-notes.md" in checked
    history = [str(p.relative_to(REPO)) for p in (REPO / "docs" / "history").rglob("*.md")]
    assert history and not checked & set(history)


def test_the_reference_has_a_section_per_hook_in_installation_order() -> None:
    """A hook added to, renamed in or dropped from ``compat.HOOKS`` changes its section in the reference too."""
    from recipecache.torch_integration.compat import HOOKS

    text = (REPO / "docs" / "torch-integration-notes.md").read_text()
    part = text.split("## The hooks", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^### `(\w+)`$", part, flags=re.M) == [hook.name for hook in HOOKS]


def test_the_reader_finds_the_references() -> None:
    """Each kind of reference is recognised in the docs as they are (a change to the patterns that finds nothing
    would pass the test above vacuously)."""
    kinds = {kind for refs in doc_references().values() for kind, _ in refs}
    assert kinds == {"path", "qualified", "file", "dotted"}
    assert ("qualified", "recipecache.backends.SCHEMES") in doc_references()["docs/DEVELOPING.md"]


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("path", "recipecache/no_such_module.py"),
        ("path", "tests/conftest.py::no_such_fixture"),
        ("qualified", "recipecache.store.NoSuchName"),
        ("qualified", "recipecache.no_such_module"),
        ("file", "behind_worker.py"),
        ("dotted", "StoreAdmin.no_such_method"),
        ("dotted", "settings.no_such_function"),
    ],
)
def test_a_stale_name_is_found(kind: str, name: str) -> None:
    assert stale(kind, name)


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("path", "tests/deploy/test_deploy_*.py"),
        ("path", "tests/torch_integration/{graphs,precompiled,no_stall}/"),
        ("qualified", "recipecache.enable"),
        ("qualified", "recipecache.store.Store.begin"),
        ("file", "_inductor/compile_fx.py"),
        ("file", "entries.py"),
        ("dotted", "store.stats"),
        ("dotted", "torch._dynamo.config"),
        ("dotted", "FxGraphCache.prepare_key"),
        ("dotted", "os.environ"),
    ],
)
def test_a_current_or_foreign_name_passes(kind: str, name: str) -> None:
    assert not stale(kind, name)
