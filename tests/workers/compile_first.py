"""A rank that compiles before it joins any group (or never does), and a multiprocessing child of it that compiles.

``compile_first.py OUT``: compiles a function (the eager backend: no inductor, no C++), then starts a child with the
``spawn`` method that does the same; each writes whether recipecache was enabled in it to ``OUT/<who>.json``
(torch's FX graphs go to a remote cache, which only recipecache's enable() sets here).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path


def compile_and_record(out: str, who: str) -> None:
    import torch

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    Path(out, f"{who}.json").write_text(json.dumps({"enabled": bool(torch._inductor.config.fx_graph_remote_cache)}))


if __name__ == "__main__":
    compile_and_record(sys.argv[1], "rank")
    child = multiprocessing.get_context("spawn").Process(target=compile_and_record, args=(sys.argv[1], "child"))
    child.start()
    child.join()
    sys.exit(child.exitcode)
