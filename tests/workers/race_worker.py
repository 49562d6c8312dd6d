"""One racing process: get_or_compile over the same keys as its siblings.

argv: URL NAMESPACE COUNTS_FILE N_KEYS OUT_FILE. Every compile appends its key to
COUNTS_FILE (O_APPEND: one small write is atomic), so the test can count compiles across
all processes; the bytes each process got back go to OUT_FILE as JSON.
"""

import hashlib
import json
import os
import random
import sys
import time

import recipecache

url, namespace, counts_file, n_keys, out_file = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
store = recipecache.open_store(url, namespace=namespace)
keys = [f"graph-{i}" for i in range(n_keys)]
random.Random(os.getpid()).shuffle(keys)


def compile_for(key: str):
    def compile_fn() -> bytes:
        fd = os.open(counts_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, (key + "\n").encode())
        os.close(fd)
        time.sleep(0.02)  # long enough that siblings meet the key while it compiles
        return hashlib.sha256(key.encode()).digest() * 1000

    return compile_fn


results = {key: hashlib.sha256(store.get_or_compile(key, compile_for(key))).hexdigest() for key in keys}
with open(out_file, "w") as f:
    json.dump({"results": results, "stats": store.stats()}, f)
