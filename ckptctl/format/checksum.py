"""Checksums: XXH3-64, the fastest per core of the candidates measured (``docs/decisions.md``,
"Checksum algorithm"; ``scripts/bench_checksums.py`` measures them again). xxhash releases the
GIL, so hashing in the writer thread does not stall training. The algorithm's name is recorded
in every manifest so that a later version can change it without misreading old checkpoints.

A shard file's checksum is built from its chunks' checksums rather than by hashing the file
again: ``XXH3-64(header bytes || the 8-byte digests of its chunks in data order)``. The
chunks tile the data section exactly (the header parser enforces it), so every byte of the
file is covered, and each byte is hashed once on every path: save, verify, copy and reshard.
Hashing the file a second time cost the writer a fifth of its throughput (``docs/decisions.md``,
"Hash each byte once").
"""

from __future__ import annotations

from typing import Iterable

import xxhash

ALGORITHM = "xxh3-64"
DIGEST_CHARS = 16  # a digest is written as exactly this many lowercase hex digits
_HEX = frozenset("0123456789abcdef")


def is_digest(s: object) -> bool:
    """Whether ``s`` is a digest as ``digest`` writes it. Nothing else is accepted where a
    digest is read (not upper case, not spaces, which ``bytes.fromhex`` would take)."""
    return isinstance(s, str) and len(s) == DIGEST_CHARS and _HEX.issuperset(s)


def digest(data: bytes | bytearray | memoryview) -> str:
    """Hex digest of a whole buffer. ``digest(b"") == "2d06800538d394c2"``."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


class Hasher:
    """Incremental form of ``digest``: ``update`` piece by piece, then ``hexdigest``."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self._h.intdigest():016x}"


def file_checksum(header: bytes | memoryview, chunk_digests: Iterable[str]) -> str:
    """The checksum of a shard file from its header bytes (everything before the data
    section, length prefix included) and its chunks' hex digests in data order."""
    h = Hasher()
    h.update(header)
    for d in chunk_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()
