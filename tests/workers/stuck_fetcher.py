"""A node's fetcher that hangs in the middle of its remote read until killed.

argv: URL NAMESPACE NODE_DIR KEY READY_FILE. It becomes its node's fetcher for KEY (its
node directory is empty), starts reading the remote store, writes READY_FILE and hangs.
"""

import os
import pathlib
import sys
import time

import recipecache

url, namespace, node_dir, key, ready = sys.argv[1:6]
os.environ["RECIPECACHE_NODE_DIR"] = node_dir
store = recipecache.open_store(url, namespace=namespace)
read = store.backend.get


def stuck_read(name: str) -> bytes | None:
    read(name)  # the bytes are on their way...
    pathlib.Path(ready).write_text("fetching")
    time.sleep(3600)  # ...and never arrive
    return None


store.backend.get = stuck_read  # type: ignore[method-assign]
store.get(key)
