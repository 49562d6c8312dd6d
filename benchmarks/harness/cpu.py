"""What a job cost in CPU, measured from the process that started it."""

from __future__ import annotations

import resource


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for descendants: a job's, g++ included. The difference
    around one job is its CPU; on a machine whose cores the job keeps busy, its wall follows it."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
