"""One rank of benchmarks/load_bench.py: gets (cold: compiles or waits for) every artifact, checks each.

usage: load_worker.py SPEC.json  (written by load_bench.py; fields below)

* ``url``, ``namespace``, ``node_dir`` (null: no node tier), ``rank``;
* ``artifacts``: ``[key, size, seed, sha256]``; an artifact's bytes are ``seed``'s random
  stream, so any rank can "compile" it and every rank can check what it got;
* ``mode``: ``cold`` (``Store.begin``: one rank compiles each key, ``compile_s`` of sleep
  plus making the bytes, the others wait for it) or ``warm`` (``Store.get``);
* ``shuffle``: meet the keys in an order of this rank's own (else all in the same order);
* ``ready``: a file to create once the store is open; ``start``: a file to wait for, so
  every rank starts at once; ``progress``: a file to
  which every finished key appends one line; ``out``: where the results go (JSON).

Never raises on a cache problem: that is what it measures. Exit status 0 unless the
worker itself is broken.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time

import numpy as np


def artifact_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec["node_dir"]:
        os.environ["RECIPECACHE_NODE_DIR"] = spec["node_dir"]
    os.environ["RANK"] = str(spec["rank"])
    import recipecache

    store = recipecache.open_store(spec["url"], namespace=spec["namespace"])
    artifacts = spec["artifacts"]
    if spec["shuffle"]:
        random.Random(spec["rank"]).shuffle(artifacts)
    open(spec["ready"], "w").close()
    while not os.path.exists(spec["start"]):
        time.sleep(0.002)
    began = time.time()
    times, corrupt, compiled, published = [], [], [], []
    progress = os.open(spec["progress"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for key, size, seed, digest in artifacts:
        start = time.perf_counter()
        if spec["mode"] == "cold":
            with store.begin(key) as flight:
                data = flight.data
                if data is None:  # leader, or a fallback: compile it here
                    time.sleep(spec["compile_s"])
                    data = artifact_bytes(size, seed)
                    store.record_compile(key, spec["compile_s"])
                    compiled.append(key)
                    if flight.publish(data):
                        published.append(key)
        else:
            data = store.get(key)
        times.append(time.perf_counter() - start)
        if data is not None and hashlib.sha256(data).hexdigest() != digest:  # None: a miss, in the stats
            corrupt.append(key)
        os.write(progress, b"x\n")
    ended = time.time()
    with open(spec["out"], "w") as f:
        json.dump({"began": began, "ended": ended, "times": times, "corrupt": corrupt,
                   "compiled": compiled, "published": published, "stats": store.stats()}, f)


if __name__ == "__main__":
    main()
