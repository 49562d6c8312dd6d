"""Per-call cost of the precompiled tier's value pins (issue 34) beside torch's own guard check.

A precompiled function serves a call only once the values its trace read besides the inputs
(the pins torch's loaded guards no longer compare: globals, torch's module attributes, the
global hook dicts) are what they were (:mod:`recipecache.torch_integration.precompiled.traced_values`).
This traces ``examples/train.py``'s TinyLM (torch's ``aot_eager`` backend: the guards are
the tier's, the graph's speed is not the point) with the tier's guard filter, then times,
median of repeats: the per-call pin check, torch's ``guard_check`` on the same call, and the
refresh of the bytecode's globals.

    python benchmarks/pins_bench.py [--repeats 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.aot_compile import aot_compile_fullgraph
from torch._dynamo.hooks import Hooks

from recipecache.torch_integration.precompiled.traced_values import Recorder, values_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train import TinyLM, make_batch  # noqa: E402


def per_call_us(fn: Callable[[], object], repeats: int, calls: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    model = TinyLM(32)
    inputs = make_batch(0, 0, 4, 8, 0)
    recorder = Recorder()
    fn = aot_compile_fullgraph(model, (inputs, {}), hooks=Hooks(guard_filter_fn=recorder),
                               backend=torch._dynamo.lookup_backend("aot_eager"))
    fn.disable_guard_check()
    values = values_of(fn, recorder.pins, type(model).forward.__globals__)
    pins = per_call_us(lambda: values.changed(lambda: fn.prepare_f_locals(model, *inputs), every=False),
                       args.repeats, args.calls)
    guards = per_call_us(lambda: fn.guard_check(model, *inputs), args.repeats, args.calls)
    refresh = per_call_us(lambda: values.refresh(fn), args.repeats, args.calls)
    per_call = sum(pin.per_call for pin in recorder.pins)
    print(f"TinyLM: {len(recorder.pins)} pins, {per_call} checked per call; medians of {args.repeats} x {args.calls} "
          f"calls; load average {os.getloadavg()[0]:.1f}")
    print(f"  pin check      {pins:7.1f} us per call")
    print(f"  torch guards   {guards:7.1f} us per call  (pins / guards = {pins / guards:.2f})")
    print(f"  globals refresh {refresh:6.2f} us per call")


if __name__ == "__main__":
    main()
