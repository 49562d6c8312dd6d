"""What tests of a waiter wait for: the moment it found another's lease held (an event, not a time).

A test that lets the holder publish, or die, "after the waiter started waiting" must know the
waiter got there: a fixed sleep was too short on a loaded machine (issue 28), and a waiter that
arrives late finds the value published (a hit, not a wait) or the dead holder's lease expired
(a free lease, not a takeover).
"""

from __future__ import annotations

import threading

from recipecache.backends.base import Backend, LeaseState


def finds_lease_held(backend: Backend) -> threading.Event:
    """An event set when a caller of ``backend`` reads a lease's holder, which a single-flight caller does
    once its own try of the lease failed (:meth:`recipecache.lease.SingleFlight.run`); ``backend`` is
    otherwise unchanged."""
    found = threading.Event()
    read_holder = backend.lease_holder

    def lease_holder(name: str) -> LeaseState | None:
        found.set()
        return read_holder(name)

    backend.lease_holder = lease_holder  # type: ignore[method-assign]
    return found
