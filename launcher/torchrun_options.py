"""The options of ``torch.distributed.run`` (torchrun) that ``recipecache-run`` passes through.

Derived from the installed torchrun's own parser (``get_args_parser()``), so a torch
release that adds an option (2.14 added ``--log-line-prefix-template``) needs no change
here. What the launcher does not pass through is named by torchrun's ``dest``: the
process count (the launcher's ``--nproc``) and the options that take the slot the
launcher's bootstrap needs or act instead of starting a job (:data:`REFUSED_REASONS`). The cost:
``recipecache-run`` imports torch before it parses anything (about 2 s), which torchrun
itself does anyway.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunOption:
    names: tuple[str, ...]
    takes_value: bool = True

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


@functools.cache
def torchrun_actions() -> tuple[argparse.Action, ...]:
    """The options of the installed torchrun's parser (help excluded), as its argparse actions."""
    from torch.distributed.run import get_args_parser

    return tuple(action for action in get_args_parser()._actions
                 if action.option_strings and not isinstance(action, argparse._HelpAction))


def _option(action: argparse.Action) -> TorchrunOption:
    return TorchrunOption(tuple(action.option_strings), action.nargs != 0)


def pass_through() -> tuple[TorchrunOption, ...]:
    """Every torchrun option passed on unchanged: all but ``--nproc-per-node`` and :func:`refused`."""
    return tuple(_option(action) for action in torchrun_actions()
                 if action.dest != NPROC_PER_NODE.dest and action.dest not in REFUSED_REASONS)


def refused() -> tuple[tuple[TorchrunOption, str], ...]:
    """The installed torchrun's options the launcher refuses, each with the reason it gives."""
    return tuple((_option(action), REFUSED_REASONS[action.dest]) for action in torchrun_actions()
                 if action.dest in REFUSED_REASONS)
