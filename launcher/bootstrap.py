"""Per-rank entry point: ``python -m launcher.bootstrap script [args]`` (torchrun's ``-m`` mode).

It lets ``recipecache-run`` enable the cache in every rank without a change to the
training script: it prepares the rank's environment, calls ``recipecache.enable()`` when
the launcher asked for it (``RECIPECACHE_AUTO_ENABLE=1``), then runs the script exactly as
``python script args`` would (:func:`run_as_main`), writes the rank's metrics and marks that
the script finished (:mod:`launcher.exit_watch`), so the launcher can end a rank that then
hangs on its way out and still report it.

``RECIPECACHE_RANK_DIRS=DIR`` gives this rank its own ``TORCHINDUCTOR_CACHE_DIR`` and
``TMPDIR`` under ``DIR/rank<RANK>`` (:func:`recipecache.autoenable.use_rank_dirs`), so ranks on one machine
cannot share through torch's local caches, as if each ran on its own node. It must happen here, before torch is
imported, because inductor and ``tempfile`` read those variables once.
"""

from __future__ import annotations

import builtins
import gc
import os
import signal
import sys
import types
from collections.abc import MutableMapping, Sequence
from importlib.machinery import SourceFileLoader
from pathlib import Path

from recipecache import env, quantities
from recipecache.autoenable import use_rank_dirs
from recipecache.errors import ConfigError
from recipecache.parent_death import die_with_parent, parent_of
from recipecache.torch_integration import write_metrics

from .exit_watch import exit_status, mark_finished


def end_with_agent(environ: MutableMapping[str, str]) -> None:
    """Have this rank killed when its torchrun agent dies; end now if the agent (or the launcher) is gone already.

    torchrun starts each rank in its own session, so an agent killed outright (SIGKILL,
    the OOM killer, a launcher that died and took it along) would leave the rank running on,
    re-parented, waiting forever on a store or collective whose other side is gone. SIGKILL,
    not SIGTERM: nobody is left to report to, and a rank stuck in C++ holding the GIL runs no
    Python handler. An agent that died before the request is seen in the rank's parent, which
    is then no longer a child of the launcher (``RECIPECACHE_LAUNCHER_PID``, set by
    ``recipecache-run``).
    """
    agent = os.getppid()
    launcher = quantities.whole(environ.get(env.LAUNCHER_PID, ""), 1, 2**31 - 1)
    if die_with_parent(signal.SIGKILL, agent) and launcher is not None and parent_of(agent) != launcher:
        os._exit(1)


def freeze_imports() -> None:
    """Take every object alive now, before the script runs (the modules enable() imported: torch, dynamo,
    inductor, sympy; some 375,000 objects), out of the cyclic garbage collector's sight (``gc.freeze``).

    They live as long as the process (modules), yet every full collection walks them all: the
    collections while torch compiles and trains, and the ones while the interpreter shuts down
    (measured, issue 27: a process that compiled a Linear took 9.0-9.5 s from its script's end to
    its exit on a loaded 2-core machine, 1.6-1.9 s frozen). Reference counting still frees a
    frozen object that is dropped; only one left in a cycle would stay (a module's own, until
    exit). Everything the script creates is collected as under ``python script``: its objects,
    with their finalizers (a file it left open is flushed at exit as before), are not frozen.
    """
    gc.freeze()


def run_as_main(script: str) -> None:
    """Run the Python source file ``script`` as ``python script`` does: as the ``__main__`` module for good.

    Not ``runpy.run_path``: that runs the script in a temporary module and hands back a
    copy of its globals, so whatever the script keeps in globals (a DDP model, with its
    reducer and process group) is destroyed in the bootstrap the moment the script
    returns: before the ``atexit`` handlers (torch's and recipecache's) and while every
    other thread may still take the GIL. A C++ destructor that joins a thread which waits
    for the GIL (gloo's work loop) then deadlocks. Here, as under ``python script.py``,
    the script's module stays in ``sys.modules`` and its globals die during interpreter
    finalization, after the ``atexit`` handlers, when other threads no longer get the GIL.
    Like Python, it drops the module's ``__file__`` and ``__cached__`` once the script returned.
    """
    path = os.path.abspath(script)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __cached__=None, __builtins__=builtins, __loader__=SourceFileLoader("__main__", path)
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - running the user's script is this module's job
    for name in ("__file__", "__cached__"):
        main.__dict__.pop(name, None)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m launcher.bootstrap script [args]  (recipecache-run starts this in each rank)")
    script = argv[0]
    try:
        use_rank_dirs(os.environ)
    except ConfigError as exc:  # bad input: one line and status 2, as a setting enable() refuses
        print(f"recipecache: error: rank {env.process_rank()}: {exc}", file=sys.stderr)
        sys.exit(2)
    if env.switch(env.AUTO_ENABLE):
        import recipecache

        try:
            recipecache.enable()
        except ConfigError as exc:  # what this rank reads is bad input: one line, as recipecache-run says it up front
            print(f"recipecache: error: rank {env.process_rank()}: {exc}", file=sys.stderr)
            sys.exit(2)
        freeze_imports()
    sys.argv = argv
    sys.path[0] = str(Path(script).resolve().parent)
    status = 1  # an exception escaping the script: Python prints it and exits 1
    try:
        run_as_main(script)
        status = 0
    except SystemExit as exc:
        status = exit_status(exc)
        raise
    finally:
        write_metrics()  # before the atexit handlers: a rank ended for hanging in one still reports
        mark_finished(status)


if __name__ == "__main__":
    end_with_agent(os.environ)  # first: a rank must not outlive its agent even while the script's imports run
    main()
