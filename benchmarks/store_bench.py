"""Store get/put latency and throughput against raw file and raw redis-py I/O, in one run.

Usage: python benchmarks/store_bench.py [--sizes 1KB,64KB,1MB,8MB,64MB] [--repeat 7]

For each payload size it measures, on the same machine in the same run, the median of
``--repeat`` timings of:

* filesystem: raw ``open/write/close`` and ``open/read`` of a file vs ``store.put/get``
  on a ``file://`` store in the same directory;
* Redis: raw redis-py ``SET``/``GET`` vs ``store.put/get`` on a ``redis://`` store, against
  a redis-server the benchmark starts on 127.0.0.1;

and prints MB/s and the ratio store/raw. The store's extra work per byte is the envelope
(one copy) and sha256 (once on put, once on get); the hash rate measured here is printed
too, because on CPUs without SHA extensions it, not I/O, bounds the ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

import recipecache
from recipecache.events import EventLog
from recipecache.sizes import format_size, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_server import RedisServer  # noqa: E402


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page cache, connection, allocator
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name: str, size: int, raw_s: float, store_s: float, hash_s: float) -> str:
    mbps = lambda s: size / s / 1e6  # noqa: E731
    return (f"{name:<12} {format_size(size):>10} {raw_s * 1e3:>10.3f} {store_s * 1e3:>10.3f} "
            f"{mbps(raw_s):>10.0f} {mbps(store_s):>10.0f} {store_s / raw_s:>7.2f}x {store_s / (raw_s + hash_s):>9.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1KB,64KB,1MB,8MB,64MB")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    print("ratio = store / raw; vs floor = store / (raw + one sha256 of the payload), the least any")
    print("verifying store can cost, since every put and every get hashes the payload once.\n")
    print(f"{'op':<12} {'size':>10} {'raw ms':>10} {'store ms':>10} {'raw MB/s':>10} {'store MB/s':>10} {'ratio':>8} "
          f"{'vs floor':>10}")

    ratios: list[tuple[str, int, float]] = []
    floor_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        fs_store = recipecache.open_store(f"file://{tmp}/store", namespace="bench")
        rd_store = recipecache.open_store(server.url, namespace="bench")
        for store in (fs_store, rd_store):
            store.events = EventLog(None)
        client = redis.Redis.from_url(server.url)
        raw_file = Path(tmp) / "raw.bin"
        for size in sizes:
            payload = secrets.token_bytes(size)
            repeat = args.repeat if size <= 8 << 20 else max(3, args.repeat // 2)
            hash_s = median_s(lambda: hashlib.sha256(payload).digest(), repeat)

            def raw_write() -> None:
                with open(raw_file, "wb") as f:
                    f.write(payload)

            def raw_read() -> bytes:
                with open(raw_file, "rb") as f:
                    return f.read()

            measured = {
                "file put": (median_s(raw_write, repeat), median_s(lambda: fs_store.put("k", payload), repeat)),
                "file get": (median_s(raw_read, repeat), median_s(lambda: fs_store.get("k"), repeat)),
                "redis put": (median_s(lambda: client.set("raw", payload), repeat),
                              median_s(lambda: rd_store.put("k", payload), repeat)),
                "redis get": (median_s(lambda: client.get("raw"), repeat), median_s(lambda: rd_store.get("k"), repeat)),
            }
            assert fs_store.get("k") == payload and rd_store.get("k") == payload
            for name, (raw_s, store_s) in measured.items():
                print(row(name, size, raw_s, store_s, hash_s))
                ratios.append((name, size, store_s / raw_s))
                if size >= 1 << 20:
                    floor_ratios.append(store_s / (raw_s + hash_s))
            print(f"{'sha256':<12} {format_size(size):>10} {hash_s * 1e3:>10.3f} {'':>10} {size / hash_s / 1e6:>10.0f}")
        client.delete("raw")
    big = [r for _n, size, r in ratios if size >= 1 << 20]
    if big:
        print(f"\nstore/raw for payloads >= 1 MiB: median {statistics.median(big):.2f}x, worst {max(big):.2f}x "
              f"(target 1.2x)")
        print(f"store/(raw + sha256) for payloads >= 1 MiB: median {statistics.median(floor_ratios):.2f}x, "
              f"worst {max(floor_ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
