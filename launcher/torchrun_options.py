"""The options of ``torch.distributed.run`` (torchrun) that ``recipecache-run`` passes through.

Derived from the installed torchrun's own parser (``get_args_parser()``), so a torch
release that adds an option (2.14 added ``--log-line-prefix-template``) needs no change
here. What the launcher does not pass through is named by torchrun's ``dest``: the
process count (the launcher's ``--nproc``) and the options that take the slot the
launcher's bootstrap needs or act instead of starting a job (:data:`REFUSED_REASONS`).

Reading that parser means importing torch (2 s on an idle machine, 5-9 s on a busy one), in
the launcher, before torchrun starts and imports torch again: time every job would pay
serially before its ranks even start. So the table is kept in a file per torch installation
(:func:`cache_file`), named by a digest of the files the parser comes from; a launcher finds
it there without importing torch, and rebuilds it whenever those files changed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from recipecache import quantities
from recipecache.errors import ConfigError, echo
from recipecache.fsutil import write_atomic

log = logging.getLogger(__name__)

#: the files of the torch package (under ``torch/``) that the option table comes from; their content names it
PARSER_SOURCES = ("version.py", "distributed/run.py", "distributed/argparse_util.py")


@dataclass(frozen=True)
class TorchrunOption:
    names: tuple[str, ...]
    takes_value: bool = True
    #: how torchrun's parser reads the value: ``int``, ``float`` or ``str`` (its ``type``)
    kind: str = "str"
    #: the values torchrun's parser allows, when it lists them
    choices: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        """The dash spelling, the one passed on to torchrun."""
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")


#: torchrun's own name for the launcher's ``--nproc`` (its dest is ``nproc_per_node``).
NPROC_PER_NODE = TorchrunOption(("--nproc-per-node", "--nproc_per_node"))

#: torchrun options the launcher refuses, by torchrun's dest, with the reason: the first
#: three pick how the script is started, and the launcher needs that slot for its
#: bootstrap (``-m launcher.bootstrap``); the last prints a shell completion for torchrun
#: instead of running anything (torch >= 2.14). Those the installed torchrun lacks are skipped.
REFUSED_REASONS: dict[str, str] = {
    "module": "starts the script itself, through launcher.bootstrap",
    "no_python": "starts the script itself, through launcher.bootstrap",
    "run_path": "starts the script itself, through launcher.bootstrap",
    "print_completion": "has no shell completion script (torchrun's is for torchrun)",
}


#: one option of torchrun's parser: its spellings, whether it takes a value, its ``dest``, how it reads the
#: value (``int``, ``float``, ``str``) and the values it allows (None: any)
Row = tuple[tuple[str, ...], bool, str, str, tuple[str, ...] | None]
#: the value kinds the launcher checks; any other ``type`` of torchrun's parser is read as a string
_KINDS = ("int", "float", "str")


def parser_rows() -> list[Row]:
    """The options of the installed torchrun's parser (help excluded), read from the parser (imports torch)."""
    from torch.distributed.run import get_args_parser

    rows: list[Row] = []
    for action in get_args_parser()._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            kind = getattr(action.type, "__name__", "str")
            choices = tuple(str(choice) for choice in action.choices) if action.choices else None
            rows.append(
                (
                    tuple(action.option_strings),
                    action.nargs != 0,
                    action.dest,
                    kind if kind in _KINDS else "str",
                    choices,
                )
            )
    return rows


def cache_file() -> Path | None:
    """Where the option table of the installed torch is kept, or None (no installed torch, no home directory).

    ``$XDG_CACHE_HOME/recipecache-run`` (default ``~/.cache``), one file per digest of
    :data:`PARSER_SOURCES` and the package's path: another torch, or the same one patched,
    has another file. Found without importing torch (``find_spec`` of a top-level package
    only locates it).
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    digest = hashlib.sha256(str(package).encode())
    try:
        for name in PARSER_SOURCES:
            digest.update(b"\0" + name.encode() + b"\0" + (package / name).read_bytes())
    except OSError:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())
    if not base.is_absolute():  # no home directory to keep it in: every launcher reads the parser
        return None
    return base / "recipecache-run" / f"torchrun-options-{digest.hexdigest()[:32]}.json"


def _read(path: Path) -> list[Row] | None:
    """The table kept in ``path``, or None when it is absent or not a well-formed table."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    rows: list[Row] = []
    for item in data if isinstance(data, list) else [None]:
        if not (
            isinstance(item, list)
            and len(item) == 5
            and isinstance(item[0], list)
            and item[0]
            and all(isinstance(n, str) and n.startswith("-") for n in item[0])
            and isinstance(item[1], bool)
            and isinstance(item[2], str)
            and item[3] in _KINDS
            and (item[4] is None or (isinstance(item[4], list) and all(isinstance(c, str) for c in item[4])))
        ):
            return None  # damaged, or kept by an older launcher (three fields): rebuilt
        rows.append((tuple(item[0]), item[1], item[2], item[3], None if item[4] is None else tuple(item[4])))
    return rows


@functools.cache
def torchrun_rows() -> tuple[Row, ...]:
    """The installed torchrun's options: from :func:`cache_file` when it holds them, else from its parser (kept)."""
    path = cache_file()
    rows = _read(path) if path is not None else None
    if rows is None:
        rows = parser_rows()
        if path is not None:
            try:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_atomic(path, json.dumps(rows).encode())
            except OSError as exc:  # only the next launcher's start is slower
                log.debug("cannot keep torchrun's options in %s: %s", path, exc)
    return tuple(rows)


def _option(row: Row) -> TorchrunOption:
    return TorchrunOption(row[0], row[1], row[3], row[4])


def pass_through() -> tuple[TorchrunOption, ...]:
    """Every torchrun option passed on unchanged: all but ``--nproc-per-node`` and :func:`refused`."""
    return tuple(
        _option(row) for row in torchrun_rows() if row[2] != NPROC_PER_NODE.dest and row[2] not in REFUSED_REASONS
    )


def refused() -> tuple[tuple[TorchrunOption, str], ...]:
    """The installed torchrun's options the launcher refuses, each with the reason it gives."""
    return tuple((_option(row), REFUSED_REASONS[row[2]]) for row in torchrun_rows() if row[2] in REFUSED_REASONS)


#: the most a whole-number option of torchrun may be: past it torchrun fails after starting, with a traceback
#: (``--max-restarts 10**20`` overflowed in its metrics)
MOST_WHOLE = 2**31 - 1
#: bounds tighter than a value kind's, by torchrun's dest (a monitor interval of 0 would spin a core)
BOUNDS: dict[str, tuple[float, float]] = {"master_port": (0, 65535), "monitor_interval": (1e-3, 3600.0)}
_STD = re.compile(r"([0-3]|[0-9]{1,7}:[0-3](,[0-9]{1,7}:[0-3])*)\Z")
#: the most nodes ``--nnodes`` may name
MOST_NODES = 10**7 - 1
_NNODES_FORM = f"N or MIN:MAX, whole numbers from 1 to {MOST_NODES}"
#: string values whose form torchrun checks only once it runs (a traceback), by dest: the pattern and its words
SYNTAX: dict[str, tuple[re.Pattern[str], str]] = {
    "nnodes": (re.compile(r"[0-9]+(:[0-9]+)?\Z"), _NNODES_FORM),
    "redirects": (_STD, "0, 1, 2 or 3, or LOCAL_RANK:0-3 pairs separated by commas"),
    "tee": (_STD, "0, 1, 2 or 3, or LOCAL_RANK:0-3 pairs separated by commas"),
    "rdzv_conf": (re.compile(r"([^=,]+=[^,]*(,[^=,]+=[^,]*)*)?\Z"), "KEY=VALUE pairs separated by commas"),
}


def environment_name(option: TorchrunOption) -> str:
    """The variable torchrun reads ``option`` from when the command line lacks it (``PET_MAX_RESTARTS``)."""
    return f"PET_{option.dest.upper()}"


def check_value(option: TorchrunOption, value: str, given_as: str | None = None) -> str:
    """``value``, or ConfigError (one line) unless torchrun will take it for ``option``: what it would reject only
    after starting, under a traceback (a bad ``--nnodes``), or take and then fail on (a huge ``--max-restarts``).
    ``given_as`` names where the value came from when not the option (its ``PET_*`` variable)."""
    low, high = BOUNDS.get(option.dest, (0, MOST_WHOLE) if option.kind == "int" else (0.0, math.inf))
    shown = f"{given_as or option.name}={echo(value)}"
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{shown} must be one of {', '.join(option.choices)}")
    if option.kind == "int" and quantities.whole(value, int(low), int(high)) is None:
        raise ConfigError(f"{shown} must be a whole number from {low:g} to {high:g}")
    if option.kind == "float" and not (quantities.decimal(value, low, high) or 0) > 0:
        raise ConfigError(f"{shown} must be a number of seconds from {low:g} to {high:g}")
    form = SYNTAX.get(option.dest)
    if form is not None and not form[0].match(value):
        raise ConfigError(f"{shown} must be {form[1]}")
    if option.dest == "nnodes":
        first, _, last = value.partition(":")
        fewest, most = quantities.whole(first, 1, MOST_NODES), quantities.whole(last or first, 1, MOST_NODES)
        if fewest is None or most is None:
            raise ConfigError(f"{shown} must be {_NNODES_FORM}")
        if fewest > most:
            raise ConfigError(f"{shown}: MIN must not be above MAX")
    return value
