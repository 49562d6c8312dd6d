"""The settings enable() makes in torch's config, for every thread of the process.

Torch keeps a setting made in code (``inductor_config.fx_graph_remote_cache = True``) per thread: a
``ContextVar`` that no other thread sees, one started later included (torch 2.13 to 2.15). enable() runs in
one thread, and the compiles need not: Ray Train runs the training function in a thread of its own, after
``init_process_group`` (where the start-up hook enables) returned in another, so its compiles never asked the
store and a fresh job compiled everything again. Hook ``every_thread`` therefore also makes each setting the
value the entry has where no thread set one (the value an environment variable such as
``TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE`` gives it): every thread sees it, and a thread's own setting still wins.

A thread that had computed a config module's hash before enable() keeps that hash (torch caches it per thread);
threads compile after enable() in the cases above.
"""

from __future__ import annotations

from typing import Any

from torch.utils._config_module import ConfigModule


def entry(owner: object, name: str) -> Any | None:
    """The config entry behind ``owner.name`` when ``owner`` is a torch config module and the entry holds its
    own value (an alias reads another entry's); None otherwise."""
    if not isinstance(owner, ConfigModule):
        return None
    found = owner._config.get(name)
    return None if found is None or getattr(found, "alias", None) else found


def swap_default(found: Any, value: Any) -> Any:
    """Make ``value`` what every thread without a setting of its own reads; returns what it was (swapped back
    by :func:`..patches.detach`)."""
    before = found.env_value_default
    found.env_value_default = value
    return before
