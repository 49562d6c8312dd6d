"""The package's layout keeps its promises: one module per backend, the core at the top, tools and run analysis in their folders."""

from __future__ import annotations

import importlib
import inspect

from recipecache.backends import SCHEMES
from recipecache.backends.base import Backend


def test_each_backend_lives_in_its_own_module() -> None:
    """A scheme's module defines exactly one backend, the one the scheme table names."""
    for scheme, target in SCHEMES.items():
        module_name, _, class_name = target.partition(":")
        module = importlib.import_module(module_name)
        defined = {name for name, obj in vars(module).items()
                   if inspect.isclass(obj) and issubclass(obj, Backend) and obj.__module__ == module_name}
        assert defined == {class_name}, (scheme, module_name, defined)


def test_doctor_and_cli_reach_the_backend_only_through_the_store() -> None:
    """They resolve nothing, open no bare backend and seal nothing by hand: the store's operator face
    (``StoreAdmin``) does it for them."""
    from recipecache.tools import cli, doctor

    for module in (cli, doctor):
        source = inspect.getsource(module)
        for bypass in ("open_backend", "envelope.", "import storage_key", ".backend.", "env.NAMESPACE"):
            assert bypass not in source, (module.__name__, bypass)


def test_the_folders_show_core_tools_and_run_analysis() -> None:
    """Operator tools live in ``recipecache.tools``, run analysis in ``recipecache.runs``; no shims at the old paths."""
    from pathlib import Path

    import recipecache

    top = Path(recipecache.__file__).parent
    assert {p.stem for p in (top / "tools").glob("*.py")} == {"__init__", "cli", "admin", "doctor"}
    assert {p.stem for p in (top / "runs").glob("*.py")} == {"__init__", "events", "keyinfo", "explain", "timeline", "report"}
    assert {p.stem for p in top.glob("*.py")} == {
        "__init__", "_lazy", "argparsing", "autoenable", "breaker", "buffers", "compile_pool", "entries", "env", "envelope", "errors", "eventlog", "flight", "fsutil",
        "health", "keylog", "keys", "lease", "metrics_schema", "node_tier", "parent_death", "reasons", "settings", "quantities", "sizes",
        "stats", "store", "store_admin"}


def test_the_core_writes_its_records_and_imports_no_reader() -> None:
    """Event and key records are written by core modules (``eventlog``, ``keylog``); ``runs/`` holds their readers,
    which nothing that writes them (the core, the torch integration) imports."""
    import ast
    from pathlib import Path

    import recipecache

    top = Path(recipecache.__file__).parent
    writers = [*top.glob("*.py"), *(top / "torch_integration").rglob("*.py")]
    for path in writers:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = "." * node.level + (node.module or "")
                assert "runs" not in source.split("."), (path.name, source)
