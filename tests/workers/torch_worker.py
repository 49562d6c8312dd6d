"""One torch.compile scenario in a fresh process: train a tiny model two steps, report JSON.

usage: torch_worker.py OUT_JSON {rc|plain} [--pgo-sizes 5,7] [--variants 8,5000] [--dist FILE] [--check-disable]

* ``rc`` calls ``recipecache.enable()`` (store, secret and metrics file from the
  environment; the report says whether the metrics file existed before exit);
  ``plain`` is torch alone.
* ``--pgo-sizes`` then calls a compiled pointwise function once per size (automatic
  dynamic: the second size recompiles it with a dynamic dimension, and PGO records that);
  ``pgo_traces`` in the report: the graphs dynamo traced for it.
* ``--variants`` then calls a reduction compiled with ``dynamic=True`` once per size:
  one graph key, and sizes on both sides of inductor's 4096-element threshold make
  torch compile a second *guard variant* of it (guards ``2 <= s0 <= 4096`` and
  ``4097 <= s0``).
* ``--dist FILE`` first joins a one-process gloo group, so torch's PGO key carries a
  rank (0) where a process without a group has none.
* ``--check-disable`` first turns torch's precompiled headers off, as a user may (so
  enable() has a value of its own to pin and disable() one to give back); it then calls
  ``recipecache.disable()``, snapshots every setting enable() changes, and compiles a
  new graph (a matmul: no C++ kernel, no g++) to show the store is no longer asked.

The digest covers every step's output, loss and gradients and the final parameters,
byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

import recipecache
from recipecache.torch_integration import mark_step, metrics


def settings() -> dict[str, str]:
    """Everything enable() may change in torch, as comparable strings."""
    import torch._dynamo.config as dynamo_config
    import torch._dynamo.pgo as dynamo_pgo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache, compile_fx, cpu_vec_isa, remote_cache
    from torch._inductor.cpu_vec_isa import VecISA

    def name(obj: Any) -> str:
        return repr(obj) if obj is None else f"{obj.__module__}.{obj.__qualname__}"

    return {
        "fx_graph_remote_cache": repr(inductor_config.fx_graph_remote_cache),
        "enable_remote_autograd_cache": repr(functorch_config.enable_remote_autograd_cache),
        "automatic_dynamic_remote_pgo": repr(dynamo_config.automatic_dynamic_remote_pgo),
        "cpp_cache_precompile_headers": repr(inductor_config.cpp_cache_precompile_headers),
        "job_id": repr(torch.compiler.config.job_id),
        "fx_backend": name(remote_cache.RemoteFxGraphCache.backend_override_cls),
        "aot_backend": name(remote_cache.RemoteAOTAutogradCache.backend_override_cls),
        "pgo_backend": name(remote_cache.RemoteDynamoPGOCache.backend_override_cls),
        "update_automatic_dynamic": name(dynamo_pgo.update_automatic_dynamic),
        "codecache.write": name(codecache.write),
        "codecache._precompile_header": name(codecache._precompile_header),
        "VecISA.check_build": name(VecISA.check_build),
        "valid_vec_isa_list": name(cpu_vec_isa.valid_vec_isa_list),
        "fx_codegen_and_compile": name(compile_fx.fx_codegen_and_compile),
        "_compile_fx_inner": name(compile_fx._compile_fx_inner),
        "FxGraphCache.iterate_over_candidates": name(codecache.FxGraphCache.iterate_over_candidates),
    }


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def train(digest: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)
    for step in range(2):
        out = compiled(torch.randn(4, 16))
        loss = out.pow(2).mean()
        loss.backward()
        for t in (out, loss, *(p.grad for p in model.parameters())):
            digest.update(t.detach().numpy().tobytes())
        opt.step()
        opt.zero_grad()
        mark_step(step)
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=("rc", "plain"))
    p.add_argument("--pgo-sizes", default="")
    p.add_argument("--variants", default="")
    p.add_argument("--dist", type=Path)
    p.add_argument("--check-disable", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.check_disable:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_cache_precompile_headers = False
    report: dict[str, Any] = {"settings_before": settings()}
    if args.dist is not None:
        torch.distributed.init_process_group("gloo", init_method=f"file://{args.dist}", rank=0, world_size=1)
    if args.mode == "rc":
        recipecache.enable()
        report["settings_enabled"] = settings()
        from recipecache.torch_integration import host_cpu

        report["cpu_fingerprint"] = host_cpu.fingerprint()

    digest = hashlib.sha256()
    train(digest)
    report["digest"] = digest.hexdigest()
    compiled_scaled = torch.compile(scaled)
    traced_before = counters["stats"]["unique_graphs"]
    for size in filter(None, args.pgo_sizes.split(",")):
        compiled_scaled(torch.linspace(0, 1, int(size)))
    report["pgo_traces"] = counters["stats"]["unique_graphs"] - traced_before
    compiled_total = torch.compile(total, dynamic=True)
    report["variant_sums"] = [compiled_total(torch.ones(int(size))).item() for size in filter(None, args.variants.split(","))]

    if args.mode == "rc":
        report["metrics"] = metrics()
        path = Path(os.environ["RECIPECACHE_METRICS_FILE"].replace("{rank}", "0"))
        report["metrics_file_before_exit"] = json.loads(path.read_text()) if path.exists() else None
    if args.check_disable:
        recipecache.disable()
        report["settings_disabled"] = settings()
        torch.compile(lambda a, b: a @ b)(torch.randn(3, 3), torch.randn(3, 3))
        report["metrics_after_disabled_compile"] = metrics()
    args.out.write_text(json.dumps(report))
    if args.dist is not None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
