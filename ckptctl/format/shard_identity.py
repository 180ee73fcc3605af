"""Binding a shard to the checkpoint that committed it, from its header alone.

A shard file's checksum (recorded per file in the manifest) is defined over the header bytes
and the chunk digests in data order (``format.checksum.file_checksum``), not over the data.
So it can be rebuilt from the header without reading any data; and since every chunk read is
checked against its digest in that header, a header that matches the manifest chains every
byte read to the marker: marker -> manifest -> file checksum -> header -> chunk digest -> data.
A shard copied in from another save (same names and shapes, different values), or a header
edited after commit, fails here before its data is used.
"""

from __future__ import annotations

from ckptctl.format.checksum import file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import ShardHeader


def header_file_checksum(h: ShardHeader) -> str | None:
    """The file checksum ``h`` implies, or None when a chunk has no digest (an old writer's
    shard: only a full read of the file can check it)."""
    in_order = sorted(h.chunks, key=lambda c: c.begin)
    digests = [c.checksum for c in in_order]
    if any(d is None for d in digests):
        return None
    return file_checksum(h.header_bytes, digests)  # type: ignore[arg-type]


def header_matches(h: ShardHeader, f: FileEntry) -> bool:
    """Whether ``h`` is the header of the file the manifest entry ``f`` committed (True when
    that cannot be told from the header alone, see ``header_file_checksum``)."""
    implied = header_file_checksum(h)
    return implied is None or implied == f.checksum
