"""The no-stall worker's replies (issue 28's adversarial pass): whatever comes back on its stdout, the rank
bounds what it reads, and a reply that is not a result ends that worker (the next job starts a new one).

The worker is a real child on real pipes; what runs in it is a stand-in that answers the way a broken
worker would (a frame header claiming a terabyte, bytes that do not unpickle, a pickle of something that is
not a result). Before: the rank tried to allocate the claimed size (MemoryError), or raised the unpickling
error, and in both cases kept the worker, whose stream was then out of step for every later job.
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from typing import Any

import pytest

pool = pytest.importorskip("recipecache.torch_integration.no_stall.pool")

ANSWERS = {
    "huge frame": struct.pack("!Q", 1 << 40) + b"x" * 64,
    "not a pickle": struct.pack("!Q", 16) + b"\x80\x05garbage!garbage",
    "not a result": struct.pack("!Q", len(pickle.dumps([1, 2]))) + pickle.dumps([1, 2]),
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_a_reply_that_is_not_a_result_ends_the_worker(answer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_popen = subprocess.Popen
    stand_in = ("import sys, time\nsys.stdin.buffer.read(8)\n"
                f"sys.stdout.buffer.write({ANSWERS[answer]!r})\nsys.stdout.flush()\ntime.sleep(600)\n")

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return real_popen([sys.executable, "-c", stand_in], **kwargs)

    monkeypatch.setattr(pool.subprocess, "Popen", popen)
    worker = pool._Worker()
    try:
        with pytest.raises(RuntimeError, match="its worker was ended"):
            worker.compile(b"job", timeout=120)
        assert not worker.alive(), "a worker whose stream is out of step is not kept"
    finally:
        worker.kill()
        worker.close(0.0)
