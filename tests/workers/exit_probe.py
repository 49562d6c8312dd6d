"""Records, from an atexit handler, what a training script's exit looks like to the handler.

Kept out of the script so that the handler holds no reference to the script's globals:
whether those globals are still alive when the atexit handlers run is what it records.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from typing import Any


def record_at_exit(out_prefix: str, model: weakref.ref[Any]) -> None:
    """Write ``<out_prefix><RANK>.json``: is the script still ``__main__``, is its model still alive.

    The collection first: a DDP model sits in reference cycles, so once nothing holds the
    script's globals it lives on only until the collector runs, at a moment nobody chose.
    (``__main__.__file__`` cannot tell the script's module: Python removes it once the
    script has run; the script's own global ``model`` can.)
    """
    gc.collect()
    alive = model()
    main = sys.modules.get("__main__")
    seen = {"main_is_script": alive is not None and getattr(main, "model", None) is alive,
            "model_alive": alive is not None}
    with open(f"{out_prefix}{os.environ.get('RANK', '0')}.json", "w", encoding="utf-8") as f:
        json.dump(seen, f)
