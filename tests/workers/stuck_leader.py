"""A leader that takes a key's lease and then hangs in its compile until killed.

argv: URL NAMESPACE KEY READY_FILE. Writes READY_FILE once it holds the lease.
"""

import pathlib
import sys
import time

import recipecache

url, namespace, key, ready = sys.argv[1:5]
store = recipecache.open_store(url, namespace=namespace)


def hang() -> bytes:
    pathlib.Path(ready).write_text("compiling")
    time.sleep(3600)
    return b""


store.get_or_compile(key, hang)
