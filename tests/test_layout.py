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
