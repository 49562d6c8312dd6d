"""Sharing torch's automatic-dynamic (PGO) decisions across ranks.

torch keys its PGO state ``pt2:dynamo-pgo::{job_id}:{rank}:{tag}:c1`` (torch/_dynamo/pgo.py
``format_cache_key``), so without help every rank learns on its own which dimensions
vary. :func:`shared_key` drops the rank, so a rank (or a restarted job) starts from what
any rank learned.

With one entry for all ranks, last-writer-wins would let a rank that only saw one size
overwrite another rank's "this dimension is dynamic"; :func:`merge` folds the stored
state into the one being written with torch's own merge (``FrameStateSizeEntry.__ior__``),
and the integration writes the result with a compare-and-set
(:meth:`recipecache.store.Store.update`): a rank that wrote meanwhile makes the merge run
again on what it wrote, so no rank's decision is lost. The key is never written with a
plain put (a plain put racing a compare-and-set is last-writer-wins).
This is the one place recipecache unpickles torch data: torch's ``CodeState`` map (and the first sizes below), from
bytes the store verified (digest, and signature when a secret is set) or that torch
itself produced in this process.

torch's state only says what varies, not in what order a job met its sizes: a fresh job reading "dynamic" traces
its first size dynamic where the job that learned it traced that size static first, and runs another graph (other
kernels, other rounding) or compiles one no job stored. :class:`Replay` keeps the replay exact: each process
records the entries of its static first trace of each frame (the *first sizes*), published beside torch's state in
the same stored value (:data:`FIRST_SIZES`, a field torch does not read, taken out before torch gets the value); a
process whose first trace of a frame meets one of them traces it static too, as that job did.
This module does not import torch (unpickling does, and torch is loaded by then).
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
import re
from typing import Any

from ..artifact import torch_pickle

#: the field of the stored PGO value (torch's JSON) holding the first sizes: {CodeId: [{input name: entry}]}, pickled
FIRST_SIZES = "recipecache_first_sizes"
#: first sizes kept per frame (one per distinct first trace of a rank or job that traced it static)
MAX_FIRST_SIZES = 16

#: per frame (torch's ``CodeId``), the first traces' entries (input name -> torch's ``FrameStateSizeEntry``)
FirstSizes = dict[Any, list[dict[str, Any]]]

_PGO_KEY = re.compile(r"^(?P<prefix>pt2:dynamo-pgo::)(?P<body>.*):c(?P<version>\d+)\Z")


def shared_key(torch_key: str) -> str:
    """``pt2:dynamo-pgo::{job}:{rank}:{tag}:cN`` -> ``...::{job}:*:{tag}:cN``; other keys unchanged.

    The job id may itself contain ``:``, so the rank is the second field from the right.
    """
    match = _PGO_KEY.match(torch_key)
    if match is None or match["body"].count(":") < 2:
        return torch_key
    job, _rank, tag = match["body"].rsplit(":", 2)
    return f"{match['prefix']}{job}:*:{tag}:c{match['version']}"


def _decode(entry: bytes) -> Any:
    return pickle.loads(torch_pickle(entry))  # noqa: S301 - this process's state, or a store entry the envelope verified


def first_sizes(value: bytes) -> FirstSizes:
    """The first sizes a stored PGO value carries ({} for one without)."""
    raw = json.loads(value).get(FIRST_SIZES)
    if raw is None:
        return {}
    found = pickle.loads(base64.b64decode(raw))  # noqa: S301 - a store entry the envelope verified
    if not isinstance(found, dict) or not all(isinstance(alts, list) for alts in found.values()):
        raise ValueError("first sizes malformed")
    return found


def torch_value(value: bytes) -> bytes:
    """The stored PGO value as torch wrote it: without :data:`FIRST_SIZES`."""
    document = json.loads(value)
    if FIRST_SIZES not in document:
        return value
    del document[FIRST_SIZES]
    return json.dumps(document).encode()


def with_first_sizes(value: bytes, sizes: FirstSizes) -> bytes:
    """torch's PGO value carrying ``sizes`` (unchanged where there are none)."""
    if not sizes:
        return value
    document = json.loads(value)
    document[FIRST_SIZES] = base64.b64encode(pickle.dumps(sizes)).decode("ascii")
    return json.dumps(document).encode()


def union(a: FirstSizes, b: FirstSizes) -> FirstSizes:
    """Every frame's first traces of ``a``, then those of ``b`` that ``a`` lacks (at most :data:`MAX_FIRST_SIZES`)."""
    result = {code_id: list(alternatives) for code_id, alternatives in a.items()}
    for code_id, alternatives in b.items():
        known = result.setdefault(code_id, [])
        for alternative in alternatives:
            if alternative not in known and len(known) < MAX_FIRST_SIZES:
                known.append(alternative)
    return result


def merge(mine: bytes, stored: bytes) -> bytes:
    """torch's PGO value ``mine`` with every decision of ``stored`` folded in (same JSON format), and the first sizes
    of both."""
    ours, theirs = _decode(mine), _decode(stored)
    for code_id, state in theirs.items():
        if code_id not in ours:
            ours[code_id] = state
            continue
        entries = ours[code_id].automatic_dynamic
        for name, entry in state.automatic_dynamic.items():
            if name in entries:
                entries[name] |= entry
            else:
                entries[name] = entry
    merged = json.dumps({"data": base64.b64encode(pickle.dumps(ours)).decode("ascii")}).encode()
    return with_first_sizes(merged, union(first_sizes(stored), first_sizes(mine)))


def same_decisions(a: bytes, b: bytes) -> bool:
    """Whether two PGO values hold the same decisions (compared as torch compares code states before writing one)
    and the same first sizes."""
    return bool(_decode(a) == _decode(b)) and bool(first_sizes(a) == first_sizes(b))


class Replay:
    """One process's first traces: those it records, and the stored ones it replays.

    :meth:`entry_for` sees every input entry dynamo merges into the process's PGO state (torch's
    ``update_automatic_dynamic``). While every entry a frame met in this process equals the one of some
    stored first trace of that frame, the call's own (static) entry drives the trace, not the shared
    decision; the first entry that differs ends the replay of that frame, and torch's decision (its
    in-process state still holds the shared one) drives every later trace, as in the job that learned it.
    A process records the entries of each frame's static first trace(s), up to its first dynamic trace.
    """

    def __init__(self) -> None:
        #: first sizes read from the store (:meth:`learn`)
        self.stored: FirstSizes = {}
        #: code id -> input name -> entry: this process's static first trace of each frame
        self.recorded: dict[Any, dict[str, Any]] = {}
        #: code id -> stored first traces every entry met so far equals
        self._candidates: dict[Any, list[dict[str, Any]]] = {}
        #: frames no longer replayed, and frames whose first static traces have ended
        self._replay_ended: set[Any] = set()
        self._recording_ended: set[Any] = set()

    def learn(self, stored: FirstSizes) -> None:
        """First sizes the store holds (read with torch's state, before its first trace in this process)."""
        self.stored = union(self.stored, stored)

    def recorded_sizes(self) -> FirstSizes:
        """This process's first traces, to publish beside torch's state."""
        return {code_id: [dict(entries)] for code_id, entries in self.recorded.items() if entries}

    def entry_for(self, code_id: Any, name: str, entry: Any, decided: Any) -> Any | None:
        """The entry to drive the trace of input ``name`` of frame ``code_id`` instead of torch's ``decided``:
        the call's own ``entry`` where this trace replays a stored first trace; None where torch's decision stands."""
        replayed = False
        if code_id not in self._replay_ended:
            candidates = self._candidates.get(code_id)
            if candidates is None:
                candidates = self.stored.get(code_id, [])
            candidates = [alternative for alternative in candidates if alternative.get(name) == entry]
            if candidates:
                self._candidates[code_id] = candidates
                replayed = decided != entry
            else:
                self._replay_ended.add(code_id)
                self._candidates.pop(code_id, None)
        if replayed or decided == entry:
            if code_id not in self._recording_ended:
                self.recorded.setdefault(code_id, {}).setdefault(name, copy.copy(entry))
        else:
            self._recording_ended.add(code_id)
        return copy.copy(entry) if replayed else None
