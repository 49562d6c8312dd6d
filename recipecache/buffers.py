"""The one name for the bytes-like values that travel between the store and its backends.

Payloads move as buffers, not necessarily ``bytes``: a writer passes an envelope's header
and payload as two buffers instead of joining them, and a reader gets a ``memoryview``
slice of what the backend read instead of a copy. Everything that accepts a ``Buffer``
must work with any of these (``len``, slicing, ``memoryview(...)``, ``==`` with bytes).
"""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview


def byte_view(data: Buffer) -> Buffer:
    """``data`` as bytes (a view of any other buffer cast to bytes), so that ``len`` counts bytes.

    A ``memoryview`` of, say, a float array has ``len`` in elements; everything that sizes,
    slices or chunks a value needs it in bytes. Not a copy.
    """
    return data if isinstance(data, bytes) else memoryview(data).cast("B")
