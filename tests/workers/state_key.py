"""The FX graph key of one fixed graph, under a process-global setting (``rank``) or under a state another
process captured (``worker``): what a no-stall worker computes for the rank.

``python state_key.py rank STATEMENT`` runs STATEMENT (a setting a training script makes), then writes
to stdout the pickled ``{"key": ..., "settings": ..., "state": capture()}`` (``settings``: the digest of
what torch's keys leave out, which the graph store adds to its keys). ``python state_key.py worker`` reads a pickled
list of such states on stdin and, one after the other in this one process (as a kept worker does),
applies each and writes the pickled list of ``{"key": ..., "settings": ..., "differences": [...]}``.
"""

from __future__ import annotations

import os  # noqa: F401 - for the statements
import pickle
import sys
from typing import Any

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.compiler.config
from torch._inductor.codecache import compiled_fx_graph_hash

from recipecache.torch_integration.no_stall import global_state
from recipecache.torch_integration.torch_settings import outside_torch_keys


def matmul_relu(x, w):  # type: ignore[no-untyped-def] - make_fx keeps annotations, which the key cannot pickle
    return (torch.relu(x @ w) + torch.zeros(3),)


def graph_key() -> str:
    """The FX key of an aten graph as inductor gets it (a matmul, and a factory op taking the default dtype)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [torch.ones(2, 3, dtype=torch.float32), torch.ones(3, 3, dtype=torch.float32)]
    gm = make_fx(matmul_relu)(*inputs)
    key, _details = compiled_fx_graph_hash(gm, inputs, {}, [])
    return key


def main() -> None:
    if sys.argv[1] == "rank":
        exec(sys.argv[2])  # noqa: S102 - the test's own statement
        state = global_state.capture()
        sys.stdout.buffer.write(pickle.dumps({"key": graph_key(), "settings": outside_torch_keys(), "state": state}))
        return
    results: list[dict[str, Any]] = []
    for state in pickle.loads(sys.stdin.buffer.read()):  # noqa: S301 - the test's own bytes
        global_state.apply(state)
        differences = global_state.differences(state)
        results.append({"key": graph_key(), "settings": outside_torch_keys(), "differences": differences})
    sys.stdout.buffer.write(pickle.dumps(results))


if __name__ == "__main__":
    main()
