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
This is the one place recipecache unpickles torch data: torch's ``CodeState`` map, from
bytes the store verified (digest, and signature when a secret is set) or that torch
itself produced in this process.
This module does not import torch (unpickling does, and torch is loaded by then).
"""

from __future__ import annotations

import base64
import json
import pickle
import re
from typing import Any

from ..artifact import torch_pickle

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


def merge(mine: bytes, stored: bytes) -> bytes:
    """torch's PGO value ``mine`` with every decision of ``stored`` folded in (same JSON format)."""
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
    return json.dumps({"data": base64.b64encode(pickle.dumps(ours)).decode("ascii")}).encode()


def same_decisions(a: bytes, b: bytes) -> bool:
    """Whether two PGO values hold the same decisions, compared as torch compares code states before writing one."""
    return bool(_decode(a) == _decode(b))
