"""One rule for every ``recipecache-run`` option's environment fallback, torchrun's model.

torchrun reads each of its options ``--foo-bar`` from ``PET_FOO_BAR`` when the command line
lacks it. recipecache-run does the same with its own prefix: ``--foo-bar`` not given takes
``RECIPECACHE_FOO_BAR`` (the store URL ``--url`` takes ``RECIPECACHE_URL``, the name every
rank reads too), by the same rule for every option of its own:

- a switch (``--no-stall``) is on for ``1``, off for ``0`` or empty, and anything else is bad
  input (a ``yes`` silently read as off would start a job without what it asked for);
- a value is checked by the option's own check, and a bad one is reported under the name it
  came by (``RECIPECACHE_EXIT_GRACE='nan' must be ...``), the same sentence either way.

Options that are torchrun's own (``--nproc`` is its ``--nproc-per-node``, and every option
passed through) keep torchrun's ``PET_*`` rule, which torchrun applies itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recipecache import env
from recipecache.argparsing import OneLineArgumentParser
from recipecache.errors import ConfigError


def environment_name(option: str) -> str:
    """``--exit-grace`` -> ``RECIPECACHE_EXIT_GRACE``."""
    return env.PREFIX + option.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class OldSpelling:
    """An earlier name of an option, still read as it (with a deprecation line)."""

    option: str
    dest: str
    instead: str
    instead_dest: str


class _OldSpellingAction(argparse.Action):
    """Stores the value under the old spelling's own dest, for :meth:`FallbackParser.parse_args` to merge."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.deprecations = [
            *getattr(namespace, "deprecations", []),
            f"{option_string} is deprecated; use {self.instead}",
        ]


@dataclass(frozen=True)
class Fallback:
    """One option of recipecache-run's own and the environment variable that stands in for it."""

    option: str
    dest: str
    switch: bool

    @property
    def variable(self) -> str:
        return environment_name(self.option)


class FallbackParser(OneLineArgumentParser):
    """An ArgumentParser whose options added by :meth:`add_own` fall back to the environment.

    After parsing, ``args.given_as`` maps each such option's ``dest`` to the name its value
    came by (the option, or the variable), for error messages; an option neither given nor
    set is None (a switch: False).
    """

    def __init__(self, *args: object, environ: Mapping[str, str] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # ArgumentParser's keywords, passed on
        self.fallbacks: list[Fallback] = []
        self.old_spellings: list[OldSpelling] = []
        self.environ = environ

    def add_own(  # ``help`` is named as argparse names it
        self, group: argparse._ActionsContainer, option: str, *names: str, switch: bool = False, help: str
    ) -> None:
        """Add ``option`` (a switch when ``switch``) with its environment fallback, named in its help."""
        variable = environment_name(option)
        if switch:
            action = group.add_argument(option, *names, action="store_true", help=f"{help} (${variable}=1)")
        else:
            action = group.add_argument(
                option, *names, metavar=option.lstrip("-").upper().replace("-", "_"), help=f"{help} (${variable})"
            )
        self.fallbacks.append(Fallback(option, action.dest, switch))

    def add_old_spelling(self, group: argparse._ActionsContainer, old: str, instead: str) -> None:
        """``old``, an earlier name of option ``instead`` (added before), read as it with a deprecation line; hidden
        from --help. Both given is bad input: which of two values the user meant is a guess (issue 44: ``--url A
        --cache B`` used B, silently)."""
        target = next(action for action in self._actions if instead in action.option_strings)
        action = group.add_argument(old, action=_OldSpellingAction, instead=instead, help=argparse.SUPPRESS)
        self.old_spellings.append(OldSpelling(old, action.dest, instead, target.dest))

    def parse_args(  # type: ignore[override]  # the one of argparse's overloads the launcher uses
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        merged = {}
        for old in self.old_spellings:
            value = getattr(parsed, old.dest)
            delattr(parsed, old.dest)
            if value is None:
                continue
            if getattr(parsed, old.instead_dest) is not None:
                self.error(f"{old.option} and {old.instead} both given: use {old.instead} only")
            setattr(parsed, old.instead_dest, value)
            merged[old.instead_dest] = old.option
        try:
            apply_fallbacks(parsed, self.fallbacks, self.environ)
        except ConfigError as exc:
            self.error(str(exc))
        parsed.given_as.update(merged)
        return parsed


def apply_fallbacks(
    args: argparse.Namespace, fallbacks: Sequence[Fallback], environ: Mapping[str, str] | None = None
) -> None:
    """Fill each option not given from its variable; record in ``args.given_as`` the name each came by."""
    environ = os.environ if environ is None else environ
    given_as: dict[str, str] = {}
    for fallback in fallbacks:
        value = getattr(args, fallback.dest)
        if value not in (None, False):
            given_as[fallback.dest] = fallback.option
            continue
        if fallback.switch:
            setattr(args, fallback.dest, env.switch(fallback.variable, environ))
        else:
            setattr(args, fallback.dest, environ.get(fallback.variable) or None)
        if getattr(args, fallback.dest) not in (None, False):  # else nobody gave it: errors name the option
            given_as[fallback.dest] = fallback.variable
    args.given_as = given_as


def given_as(args: argparse.Namespace, dest: str) -> str:
    """The name the value of ``dest`` came by (``--threads`` or ``RECIPECACHE_THREADS``), for one-line errors; the
    option when nobody gave it (a variable nobody set is never blamed)."""
    return str(getattr(args, "given_as", {}).get(dest, "--" + dest.replace("_", "-")))
