"""Per-rank entry point: ``python -m launcher.bootstrap script [args]`` (torchrun's ``-m`` mode).

It lets ``recipecache-run`` enable the cache in every rank without a change to the
training script: it prepares the rank's environment, calls ``recipecache.enable()`` when
the launcher asked for it (``RECIPECACHE_AUTO_ENABLE=1``), then runs the script as
``python script args`` would: ``__name__ == "__main__"``, ``sys.argv`` starting with the
script, the script's directory first on ``sys.path``.

``RECIPECACHE_RANK_DIRS=DIR`` gives this rank its own ``TORCHINDUCTOR_CACHE_DIR`` and
``TMPDIR`` under ``DIR/rank<RANK>``, so ranks on one machine cannot share through torch's
local caches, as if each ran on its own node. It must happen here, before torch is
imported, because inductor and ``tempfile`` read those variables once.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from recipecache import env


def use_rank_dirs(environ: MutableMapping[str, str]) -> None:
    """Point this rank's torch caches and temp files at ``$RECIPECACHE_RANK_DIRS/rank<RANK>``."""
    base = environ.get(env.RANK_DIRS)
    if not base:
        return
    rank_dir = Path(base) / f"rank{environ.get('RANK', '0')}"
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TMPDIR", "tmp")):
        path = rank_dir / sub
        path.mkdir(parents=True, exist_ok=True)
        environ[name] = str(path)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m launcher.bootstrap script [args]  (recipecache-run starts this in each rank)")
    script = argv[0]
    use_rank_dirs(os.environ)
    if env.flag(env.AUTO_ENABLE):
        import recipecache

        recipecache.enable()
    sys.argv = argv
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
