"""A process of the precompiled tier that imports its model, then calls it only when told to.

usage: precompile_version.py OUT_JSON rc MODEL_DIR SIZES [--go FILE]

Imports ``f`` from ``MODEL_DIR/pv_model.py`` and calls ``recipecache.enable(precompile=True)``
(store and secret from the environment), then writes ``OUT_JSON.ready``. With ``--go``
it waits for FILE to exist (the test edits the model file and lets another process
publish meanwhile, as happens to a long job on a shared checkout), then calls
``torch.compile(f, dynamic=False)`` on ``torch.ones(n)`` for each n in SIZES (comma
separated) and reports the results and the metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

#: how long the process waits for its go file before it gives up (the test fails then)
GO_TIMEOUT_S = 900


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=("rc",))  # the other workers' argument order; recipecache is always on
    p.add_argument("model_dir")
    p.add_argument("sizes")
    p.add_argument("--go", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, args.model_dir)
    import pv_model

    import recipecache

    recipecache.enable(precompile=True)
    args.out.with_suffix(".ready").touch()
    deadline = time.monotonic() + GO_TIMEOUT_S
    while args.go is not None and not args.go.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{args.go} did not appear in {GO_TIMEOUT_S} s")
        time.sleep(0.1)
    compiled = torch.compile(pv_model.f, dynamic=False)
    results = [compiled(torch.ones(int(n))).item() for n in args.sizes.split(",")]
    from recipecache.torch_integration import metrics

    args.out.write_text(json.dumps({"results": results, "metrics": metrics()}))


if __name__ == "__main__":
    main()
