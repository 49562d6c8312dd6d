"""One process of a simulated node: reads the same artifacts as its siblings, all at once.

argv: URL NAMESPACE NODE_DIR START_FILE OUT_FILE KEY...  Opens the store with NODE_DIR as
its node directory, writes OUT_FILE.ready (the test waits for every process's), waits
until START_FILE exists (so every process starts together),
gets every KEY and writes the sha256 of each payload and the store's stats to OUT_FILE.
"""

import hashlib
import json
import os
import sys
import time

import recipecache

url, namespace, node_dir, start_file, out_file, *keys = sys.argv[1:]
os.environ["RECIPECACHE_NODE_DIR"] = node_dir
store = recipecache.open_store(url, namespace=namespace)
with open(out_file + ".ready", "w"):
    pass
while not os.path.exists(start_file):
    time.sleep(0.005)
digests = {}
for key in keys:
    data = store.get(key)
    digests[key] = None if data is None else hashlib.sha256(data).hexdigest()
with open(out_file, "w") as f:
    json.dump({"digests": digests, "stats": store.stats()}, f)
