"""Store get/put latency and throughput against raw file and raw redis-py I/O, in one run.

Usage: python benchmarks/store_bench.py [--sizes 1KB,64KB,1MB,8MB,64MB] [--repeat 9]

For each payload size it measures, on the same machine in the same run, interleaved
(raw, store, raw, store, ...) so that load from other processes hits both alike, the
median of ``--repeat`` timings of:

* filesystem: raw ``open/write/close`` of a new file and ``open/read`` of a file holding the
  same bytes vs ``store.put`` of a new key and ``store.get`` on a ``file://`` store in the
  same directory;
* Redis: raw redis-py ``SET`` of a new key and ``GET`` of the same bytes vs ``store.put/get``
  on a ``redis://`` store, against a redis-server the benchmark starts on 127.0.0.1;

and prints MB/s and the ratio store/raw (target for 8 MB and 64 MB: <= 1.3x). Every put
writes a new file or key, as a cache publishes each artifact once: replacing an existing
file costs ext4 several milliseconds more either way (it allocates and starts writing the
new file's blocks at the rename or the close after a truncate, and frees the old ones),
which would measure the filesystem, not the store. The store's
extra work per byte is one BLAKE3 of the payload on put and on get (``envelope.digest``,
threaded for payloads >= 1 MiB) and no copy: the header and the payload are written as two
buffers, and ``get`` returns a view of what the backend read. ``vs floor`` is store /
(raw + that one digest), the least any verifying store can cost without overlapping the
two; the digest rate measured here is printed too, since on a machine with few cores it,
not I/O, bounds the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

import recipecache
from harness.redis_server import RedisServer
from recipecache import envelope
from recipecache.eventlog import EventLog
from recipecache.sizes import format_size, parse_size
from recipecache.store_admin import StoreAdmin

TARGET = 1.3
TARGET_SIZES = (8_000_000, 64_000_000)


def interleaved_medians(raw: Callable[[], object], store: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median seconds of ``raw`` and of ``store``, timed alternately after one warm-up of each."""
    raw(), store()  # page cache, connections, allocator
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((raw, times[0]), (store, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name: str, size: int, raw_s: float, store_s: float, hash_s: float) -> str:
    mbps = lambda s: size / s / 1e6  # noqa: E731
    return (f"{name:<10} {format_size(size):>10} {raw_s * 1e3:>10.3f} {store_s * 1e3:>10.3f} "
            f"{mbps(raw_s):>9.0f} {mbps(store_s):>10.0f} {store_s / raw_s:>7.2f}x {store_s / (raw_s + hash_s):>9.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1KB,64KB,1MB,8MB,64MB")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; medians of {args.repeat} interleaved runs")
    print("ratio = store / raw; vs floor = store / (raw + one BLAKE3 digest of the payload)\n")
    print(f"{'op':<10} {'size':>10} {'raw ms':>10} {'store ms':>10} {'raw MB/s':>9} {'store MB/s':>10} {'ratio':>8} "
          f"{'vs floor':>10}")

    targets: list[tuple[str, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        fs_store = recipecache.open_store(f"file://{tmp}/store", namespace="bench")
        rd_store = recipecache.open_store(server.url, namespace="bench")
        for store in (fs_store, rd_store):
            store.events = EventLog(None)
        client = redis.Redis.from_url(server.url)
        for size in sizes:
            payload = secrets.token_bytes(size)
            repeat = args.repeat if size <= 8 << 20 else max(3, args.repeat // 2)
            hash_s = median_s(lambda: envelope.digest(payload), repeat)

            fresh = itertools.count()  # every put writes a new file or key
            raw_read_file = Path(tmp) / "raw-get.bin"
            raw_read_file.write_bytes(payload)
            client.set("raw-get", payload)
            fs_store.put("get", payload)
            rd_store.put("get", payload)

            def raw_write() -> None:
                with open(Path(tmp) / f"raw-{next(fresh)}.bin", "wb") as f:
                    f.write(payload)

            def raw_read() -> bytes:
                with open(raw_read_file, "rb") as f:
                    return f.read()

            measured = {
                "file put": interleaved_medians(raw_write, lambda: fs_store.put(f"put-{next(fresh)}", payload), repeat),
                "file get": interleaved_medians(raw_read, lambda: fs_store.get("get"), repeat),
                "redis put": interleaved_medians(lambda: client.set(f"raw-{next(fresh)}", payload),
                                                 lambda: rd_store.put(f"put-{next(fresh)}", payload), repeat),
                "redis get": interleaved_medians(lambda: client.get("raw-get"), lambda: rd_store.get("get"), repeat),
            }
            assert fs_store.get("get") == payload and rd_store.get("get") == payload
            for path in Path(tmp).glob("raw-*.bin"):
                path.unlink()
            fs_entries = StoreAdmin(fs_store)
            for entry in fs_entries.scan():
                fs_entries.delete_raw(entry.key)
            client.flushall()
            for name, (raw_s, store_s) in measured.items():
                print(row(name, size, raw_s, store_s, hash_s))
                if size in TARGET_SIZES:
                    targets.append((name, size, store_s / raw_s))
            print(f"{'blake3':<10} {format_size(size):>10} {hash_s * 1e3:>10.3f} {'':>10} {size / hash_s / 1e6:>9.0f}")
    if targets:
        print(f"\nstore/raw at 8 MB and 64 MB (target <= {TARGET}x):")
        for name, size, ratio in targets:
            print(f"  {name:<10} {format_size(size):>10} {ratio:6.2f}x {'ok' if ratio <= TARGET else 'over'}")
        ratios = [r for _n, _s, r in targets]
        print(f"  median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
