"""A stand-in for the Intel Gaudi PyTorch bridge's on-disk recipe cache (there is no Gaudi here).

It follows the file protocol that ``recipecache.hpu`` assumes (the package docstring
says which parts Intel documents and which are assumptions), written independently of
the agent's code so that the tests check the agent against the protocol, not against
itself:

* a recipe is ``<name>.recipe`` plus ``<name>.meta``; the metadata here is JSON with the
  recipe's size and sha256, so a lookup can tell a complete recipe from a torn one;
* a writer creates the metadata file, takes ``flock(LOCK_EX | LOCK_NB)`` on it, writes
  the recipe, then the metadata, then unlocks; a writer that cannot get the lock, or
  finds the metadata non-empty, does not write (first writer wins);
* a lookup takes ``flock(LOCK_SH | LOCK_NB)`` and never waits: a busy lock, missing or
  empty metadata, or a recipe that does not match it is a miss, and the rank compiles.

Not simulated: clearing on start and size-cap eviction (on a node the tests leave both
to the agent).

As a process (one per simulated rank) it reads ``PT_HPU_RECIPE_CACHE_CONFIG`` like the
bridge and answers one line per command on stdin::

    run NAME SIZE        look NAME up: "hit NAME", or compile (sleep), write, "compiled NAME"
    stall NAME SIZE AT   start writing NAME and stop holding the lock, AT=recipe (half the
                         recipe, no metadata) or AT=meta (everything but the unlock): "stalled NAME"
    finish               complete the stalled write: "written NAME"
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from recipecache.hpu import ENV_VAR, parse_config
from recipecache.hpu.recipes import META_SUFFIX, RECIPE_SUFFIX


def recipe_bytes(name: str, size: int) -> bytes:
    """The deterministic "compiled" recipe of ``name``."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def lookup(directory: Path, name: str) -> bool:
    """The bridge's non-waiting lookup: True for a complete recipe (a hit)."""
    try:
        fd = os.open(directory / f"{name}{META_SUFFIX}", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        meta = json.loads(os.read(fd, 1 << 16))
        recipe = (directory / f"{name}{RECIPE_SUFFIX}").read_bytes()
    except (BlockingIOError, ValueError, FileNotFoundError):
        return False
    finally:
        os.close(fd)
    return len(recipe) == meta["size"] and hashlib.sha256(recipe).hexdigest() == meta["sha256"]


def write(directory: Path, name: str, size: int, pause: Callable[[str], None] = lambda at: None) -> bool:
    """The bridge's first-writer-wins write; ``pause(at)`` runs at the two points a test may stall."""
    fd = os.open(directory / f"{name}{META_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if os.fstat(fd).st_size > 0:
            return False
        data = recipe_bytes(name, size)
        with open(directory / f"{name}{RECIPE_SUFFIX}", "wb") as f:
            f.write(data[: size // 2])
            f.flush()
            pause("recipe")
            f.write(data[size // 2 :])
        os.write(fd, json.dumps({"size": size, "sha256": hashlib.sha256(data).hexdigest()}).encode())
        pause("meta")
        return True
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-s", type=float, default=0.1)
    args = parser.parse_args()
    directory = Path(parse_config(os.environ[ENV_VAR]).path)
    directory.mkdir(parents=True, exist_ok=True)

    def reply(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        command, name, *rest = line.split()
        if command == "run":
            if lookup(directory, name):
                reply(f"hit {name}")
                continue
            time.sleep(args.compile_s)
            write(directory, name, int(rest[0]))
            reply(f"compiled {name}")
        elif command == "stall":
            size, stall_at = int(rest[0]), rest[1]

            def pause(at: str, stall_at: str = stall_at, name: str = name) -> None:
                if at == stall_at:
                    reply(f"stalled {name}")
                    assert sys.stdin.readline().strip() == "finish"

            write(directory, name, size, pause)
            reply(f"written {name}")


if __name__ == "__main__":
    main()
