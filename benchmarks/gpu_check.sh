#!/usr/bin/env bash
# The GPU checks (issue 23) in one run on a CUDA machine: what torch/Triton are there,
# which of torch's hook points the integration needs exist, then first_step_bench on
# cuda for each torch.compile mode: a fresh process (empty inductor and Triton caches)
# on the graph store and on the precompiled tier, against torch's own warm local cache,
# counting Triton compiles and autotuning runs the fresh process still did.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh [modes...]   (default: default reduce-overhead max-autotune)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
python3 - <<'PY' 2>&1 | tee "$OUT/hook-points.txt"
import importlib, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing", e)
points = {
    "torch._inductor.codecache": ["write", "compiled_fx_graph_hash", "_precompile_header", "FxGraphCache.iterate_over_candidates"],
    "torch._inductor.cpu_vec_isa": ["valid_vec_isa_list", "VecISA.check_build"],
    "torch._inductor.compile_fx": ["fx_codegen_and_compile", "_compile_fx_inner"],
    "torch._inductor.remote_cache": ["RemoteFxGraphCache.backend_override_cls", "RemoteAOTAutogradCache.backend_override_cls",
                                     "RemoteDynamoPGOCache.backend_override_cls", "RemoteAutotuneCache.backend_override_cls",
                                     "RemoteBundledAutotuneCache.backend_override_cls", "RemoteFxGraphCache._get_key"],
    "torch._inductor.config": ["fx_graph_remote_cache", "cpp_cache_precompile_headers", "autotune_remote_cache",
                               "bundled_autotune_remote_cache", "bundle_triton_into_fx_graph_cache"],
    "torch._functorch.config": ["enable_remote_autograd_cache"],
    "torch._dynamo.config": ["automatic_dynamic_remote_pgo"],
    "torch.compiler.config": ["job_id"],
}
for module, names in points.items():
    m = importlib.import_module(module)
    for name in names:
        obj, ok = m, True
        for part in name.split("."):
            if not hasattr(obj, part):
                ok = False
                break
            obj = getattr(obj, part)
        print(f"{'ok     ' if ok else 'MISSING'} {module}.{name}")
import torch._inductor.config as c
print("bundle_triton_into_fx_graph_cache =", getattr(c, "bundle_triton_into_fx_graph_cache", None))
PY
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(default reduce-overhead max-autotune)
for mode in "${modes[@]}"; do
  echo "=== first_step_bench --device cuda --mode $mode"
  timeout "${MODE_TIMEOUT:-200}" python3 benchmarks/first_step_bench.py --device cuda --mode "$mode" --models mlp \
    --pairs "${PAIRS:-1}" --workdir "/tmp/fsb-$mode" --json "$OUT/first-step-$mode.json" 2>&1 | tee "$OUT/first-step-$mode.log"
done
