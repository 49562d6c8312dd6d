"""A process of the precompiled tier whose traced function reads values that are not in its code.

usage: precompile_values.py OUT_JSON rc MODEL_DIR {publish|change}

``MODEL_DIR/pvals_model.py`` (written by the test) defines ``f(x, k=<default>)``, which adds
``x * k``, its module's global ``SHIFT``, ``pvals_cfg.SCALE`` (another module's attribute) and
``Consts.FACTOR`` (a class from another module), and ``make(cell)``, whose function ``g(x)``
adds its closure cell to ``2 * x``. ``recipecache.enable(precompile=True)`` takes the store from
the environment.

``publish``: one call of each with the values the file defines (both artifacts are published).

``change``: each case changes one value the way a process holding other code or config would,
compiles the function afresh (a new dispatcher, so the store is asked again) and calls it
once; then the values are the producer's again. The first case is the file's own default
(the test edited the source); after it ``f`` gets the producer's default back. ``runtime``
loads ``f``'s artifact with the producer's values, then changes ``SHIFT`` between two calls.

Reported: per case the result's first element and eager's, and the metrics after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=("rc",))  # the other workers' argument order; recipecache is always on
    p.add_argument("model_dir")
    p.add_argument("scenario", choices=("publish", "change"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, args.model_dir)
    import pvals_cfg
    import pvals_model

    import recipecache
    from recipecache.torch_integration import metrics

    recipecache.enable(precompile=True)
    x = torch.ones(3)
    f, g = pvals_model.f, pvals_model.make(10000.0)
    report: dict[str, Any] = {}

    def case(name: str, fn: Callable[..., Any], change: Callable[[], Any], restore: Callable[[], Any]) -> None:
        change()
        compiled = torch.compile(fn, dynamic=False)
        report[name] = {"result": compiled(x)[0].item(), "eager": fn(x)[0].item(),
                        "fallbacks": dict(metrics()["precompile_fallbacks"])}
        restore()

    def set_cell(value: float) -> None:
        g.__closure__[0].cell_contents = value  # type: ignore[index]

    if args.scenario == "publish":
        case("publish_f", f, lambda: None, lambda: None)
        case("publish_g", g, lambda: None, lambda: None)
    else:
        case("default", f, lambda: None, lambda: setattr(f, "__defaults__", (2.0,)))
        case("module_attribute", f, lambda: setattr(pvals_cfg, "SCALE", 200.0),
             lambda: setattr(pvals_cfg, "SCALE", 100.0))
        case("class_attribute", f, lambda: setattr(pvals_cfg.Consts, "FACTOR", 2000.0),
             lambda: setattr(pvals_cfg.Consts, "FACTOR", 1000.0))
        case("closure_cell", g, lambda: set_cell(20000.0), lambda: set_cell(10000.0))
        compiled = torch.compile(f, dynamic=False)
        loaded = compiled(x)[0].item()
        pvals_model.SHIFT = 20.0
        report["runtime"] = {"loaded": loaded, "result": compiled(x)[0].item(), "eager": f(x)[0].item(),
                             "fallbacks": dict(metrics()["precompile_fallbacks"])}
    report["metrics"] = metrics()
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
