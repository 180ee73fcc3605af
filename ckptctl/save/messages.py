"""The fixed-size messages a multi-rank save exchanges over the coordination group.

Each rank sends rank 0 one ``RankReport`` and rank 0 answers every rank with one (action,
message) pair, both as JSON in a zero-padded uint8 tensor of a fixed size. A fixed size means
one ``gather`` and one ``broadcast`` (``gather_object`` and ``broadcast_object_list`` would
first exchange sizes, then pickled data), and no pickle at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ckptctl.format import parse
from ckptctl.format.manifest import FileEntry


@dataclass(frozen=True)
class RankReport:
    """What one rank tells rank 0 after its write."""

    rank: int
    step: int
    file: FileEntry | None  # None when the write failed
    error: str | None
    structure: str  # digest of the state's global structure (shard_layout.structure_digest)
    replanned: bool  # its layout changed since the last committed save
    stats: dict[str, float]
    replicas: str = ""  # combined digest of its replicated tensors (``replicas.combined``); "" if none


REPORT_BYTES = 1024  # one rank's report: ~350 bytes, plus room for an error message
ANSWER_BYTES = 4096  # rank 0's answer: the outcome, naming up to a few failing ranks


def pack(doc: object, size: int, *, shorten: object) -> torch.Tensor:
    """``doc`` as JSON in a zero-padded uint8 tensor of ``size`` bytes; the string at key or
    index ``shorten`` is cut to fit (an error message may be arbitrarily long)."""
    raw = json.dumps(doc).encode()
    if len(raw) > size:
        text = doc[shorten]  # type: ignore[index]
        # Bytes left for the string once everything else is encoded; characters escape to
        # 1 to 12 bytes of JSON, so they are counted one by one.
        budget = size - (len(raw) - len(json.dumps(text).encode())) - len(json.dumps(" [...]").encode())
        used, keep = 0, 0
        for ch in text:
            used += len(json.dumps(ch).encode()) - 2
            if used > budget:
                break
            keep += 1
        doc[shorten] = text[:keep] + " [...]"  # type: ignore[index]
        raw = json.dumps(doc).encode()
    out = torch.zeros(size, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


MAX_MESSAGE_DEPTH = 8  # a report nests three levels (report -> file entry -> chunk digests)


def unpack(t: torch.Tensor) -> object:
    """The document ``pack`` put in ``t``, through the one bounded parser every JSON read takes
    (``format.parse``: size, nesting, finite numbers): a message garbled on the wire is a
    clear ``InvalidCheckpoint`` naming it, never a ``RecursionError`` in the middle of a save."""
    raw = bytes(t.numpy().tobytes()).rstrip(b"\0")
    return parse.load_json(raw, "", "inter-rank save message", max_bytes=t.numel(), max_depth=MAX_MESSAGE_DEPTH,
                           allow_nonfinite=True)
