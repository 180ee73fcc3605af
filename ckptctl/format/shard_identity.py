"""Binding a shard to the checkpoint that committed it, from its header alone.

A shard file's checksum (recorded per file in the manifest) is defined over the header bytes
and the chunk digests in data order (``format.checksum.file_checksum``), not over the data.
So it can be rebuilt from the header without reading any data; and since every chunk read is
checked against its digest in that header, a header that matches the manifest chains every
byte read to the marker: marker -> manifest -> file checksum -> header -> chunk digest -> data.
The header bytes hashed are all of them, from the 8-byte length prefix to the last byte of
padding, so the chunk index, the chunk offsets and the per-rank state (RNG, data loader) in
the header are bound too; the manifest's file size and the tiling rule (``format.shard``)
leave no byte after the last chunk. ``man/ckptctl-format.5``, CHECKSUMS, lists every byte.

The chain has no optional link: a shard without ckptctl's chunk index, or with a chunk that
has no digest, is corrupt (there is no "cannot tell"). It is never read as plain safetensors.
A shard copied in from another save (same names and shapes, different values), or a header
edited after commit, fails here before any field of it is used.
"""

from __future__ import annotations

from ckptctl.format.checksum import file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import ShardHeader


def header_file_checksum(h: ShardHeader) -> str | None:
    """The file checksum ``h`` implies, or None when it implies none (no chunk index, or a
    chunk without a digest: such a shard is corrupt)."""
    in_order = sorted(h.chunks, key=lambda c: c.begin)
    digests = [c.checksum for c in in_order]
    if not h.indexed or any(d is None for d in digests):
        return None
    return file_checksum(h.header_bytes, digests)  # type: ignore[arg-type]


def header_mismatch(h: ShardHeader, f: FileEntry) -> str | None:
    """Why ``h`` is not the header of the file the manifest entry ``f`` committed, or None
    when it is (one line, for a message naming the file)."""
    if not h.indexed:
        return "shard header has no ckptctl chunk index, so none of its bytes can be checked"
    implied = header_file_checksum(h)
    if implied is None:
        return "shard header has a chunk without a checksum, so its bytes cannot be checked"
    if implied != f.checksum:
        return "shard header does not match the file checksum in the manifest"
    return None


def header_matches(h: ShardHeader, f: FileEntry) -> bool:
    """Whether ``h`` is the header of the file the manifest entry ``f`` committed."""
    return header_mismatch(h, f) is None
