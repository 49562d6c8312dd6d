"""Shipped kernel libraries on the receiving side (issue 28's adversarial pass): what torch will dlopen after a
hit is the verified library the artifact carries, byte for byte.

torch builds a kernel by running g++ with the final ``<xx>/<hash>.so`` as its output: a compile killed
mid-link (a no-stall worker ended at its deadline, a rank SIGKILLed) leaves a torn library at the name,
and the next job's hit found "a file is there" and kept it, so the rank loaded the torn file (a failed
load, a graph compiled again), never the verified one it had in hand.
"""

from __future__ import annotations

from pathlib import Path

from recipecache.torch_integration.artifact import KernelFile, install

KERNEL = KernelFile("ab/cdef.main.so", b"\x7fELF verified library" * 100)


def test_a_torn_library_at_the_kernels_name_is_replaced_by_the_verified_one(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    torn = root / "ab" / "cdef.main.so"
    torn.write_bytes(KERNEL.data[: len(KERNEL.data) // 3])
    assert install([KERNEL], root) == 1
    assert torn.read_bytes() == KERNEL.data
    assert install([KERNEL], root) == 0, "the same library already there is kept (it may be loaded)"
    assert sorted(p.name for p in (root / "ab").iterdir()) == ["cdef.main.so"], "no temp file left"
