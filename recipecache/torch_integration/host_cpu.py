"""Which CPUs may run this host's compiled kernels: the host-CPU part of every CPU artifact's key.

torch's FX-graph key describes no CPU when there is no GPU (``CacheBase.get_system()`` is
empty), yet the C++ kernels inductor builds are compiled with ``-march=native`` and its
generated code uses the vector ISA torch picked for this CPU (AVX2, AVX-512, AMX, ...). A
kernel built on an AVX-512/AMX host and loaded on an AVX2 host dies with SIGILL. So the
store keys of graphs, AOTAutograd entries and the ISA-probe libraries carry
:func:`fingerprint`, a digest of:

* what the compiler makes of torch's ``-march`` flag on this host: the macros
  ``<c++> -march=native -dM -E`` predefines (every enabled ISA extension, the tuning
  target, the compiler version; gcc and clang both answer it). One compiler run per
  process, about 30 ms;
* the inputs of torch's vector-ISA choice: the CPU features torch reads through cpuinfo
  (``torch.cpu.get_capabilities()``, its booleans only: not core counts or cache sizes),
  the ATen capability and ``ATEN_CPU_CAPABILITY``;
* the machine type.

Hosts with equal fingerprints build interchangeable kernels; any difference keeps their
artifacts apart, so each kind of CPU compiles once (single-flighted per kind) and never
loads another kind's code. PGO decisions describe the program, not the CPU, and stay
shared.

``RECIPECACHE_CPU_FINGERPRINT`` replaces the computed value: it is the operator's statement
that every node setting it to the same string runs the same kernels safely (identical CPUs
whose fingerprints differ only in something harmless), and the tests' way to play two
kinds of host on one machine. This module imports torch only inside :func:`fingerprint`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
from typing import Any

from .. import env

log = logging.getLogger(__name__)

#: seconds the compiler gets to describe ``-march=native``
_COMPILER_TIMEOUT_S = 30.0


def fingerprint() -> str:
    """This host's CPU fingerprint: ``$RECIPECACHE_CPU_FINGERPRINT``, or a 16-hex digest computed once per process.

    Raises ConfigError for an override that is not 1-64 characters of ``A-Z a-z 0-9 . _ -``.
    """
    return env.cpu_fingerprint_override() or _computed()


@functools.cache
def _computed() -> str:
    description = describe()
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    log.debug("recipecache: host CPU fingerprint %s", digest)
    return digest


def describe() -> dict[str, Any]:
    """What :func:`fingerprint` digests (see the module docstring)."""
    import torch
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    capabilities: dict[str, Any] = getattr(torch.cpu, "get_capabilities", dict)()
    return {
        "machine": platform.machine(),
        "cpu_features": sorted(name for name, value in capabilities.items() if value is True),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "compiler_target": compiler_target(compiler, arch_flags(compiler)),
    }


def arch_flags(compiler: str) -> list[str]:
    """The ``-march``-style flags torch builds kernels with (``config.cpp.march``; default ``-march=native``)."""
    try:
        from torch._inductor.cpp_builder import _get_cpu_arch_cflags

        return [f"-{flag}" for flag in _get_cpu_arch_cflags(compiler)]
    except (ImportError, AttributeError):  # a torch that names it otherwise
        return ["-march=native"]


def compiler_target(compiler: str, flags: list[str]) -> list[str]:
    """The macros ``compiler`` predefines for ``flags`` on this host, sorted; or why it could not say.

    Without a working compiler this host cannot build kernels, but it may still load
    shipped ones: the CPU features above then tell its kind apart.
    """
    try:
        result = subprocess.run(
            [compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull],
            capture_output=True,
            text=True,
            timeout=_COMPILER_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"unavailable: {type(exc).__name__}"]
    if result.returncode != 0:
        return [f"unavailable: exit {result.returncode}"]
    return sorted(line for line in result.stdout.splitlines() if line.startswith("#define "))
