"""Writing one rank's shard from its staging buffer (runs on the background thread).

Every byte is hashed once (its chunk's checksum, which the file checksum is built from; see
``format.checksum``) and written once, straight from the staging buffer. XXH3 runs at tens of
GB/s and releases the GIL, so the training thread does not notice.

The header comes first in the file and holds every chunk's checksum. Where the writer can
overwrite what it wrote (POSIX, ``LocalWriter.overwrite``), the header's length is known before
any checksum is: checksums are fixed-width, so a header built with placeholder checksums has
the final length. The writer reserves it, then hashes and writes the data section piece by
piece (each piece still in the CPU cache when it is written, and the disk busy from the first
piece on), then writes the real header over the placeholder. The file is fsynced after that,
so what becomes visible is exactly the bytes of the hash-first path. Object stores cannot
rewrite their first part, so there every chunk is hashed first, then header and data go out.

A shard is published, never replaced (``Writer.publish``): under its canonical name when
nothing has it, else under the save attempt's own name (``layout.attempt_name``). A name taken
means another attempt at this step (a dead save's leftover, a zombie job) got there first;
its file is left alone, whoever it belongs to, and the manifest records the name we used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from ckptctl.errors import CkptError, RefusedForSafety
from ckptctl.format.checksum import Hasher, digest, file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.save.shard_layout import ShardLayout, Slot, file_pieces
from ckptctl.settings import STREAM_PIECE, WRITE_PIECE
from ckptctl.storage.base import Storage, Writer

log = logging.getLogger("ckptctl")

# Any 16 hex digits: every XXH3-64 checksum is written with exactly this many.
_PLACEHOLDER = "0" * 16


@dataclass(frozen=True)
class ShardReport:
    """What a rank tells the coordinator about its durable shard."""

    file: FileEntry
    slots: tuple[Slot, ...]  # which tensors (and which regions of them) the shard holds


def write_shard(ckpt: Storage, name: str, layout: ShardLayout, buf: torch.Tensor, *, rank: int, rank_state: dict,
                fallback: str | None = None, writer: Writer | None = None) -> ShardReport:
    """Write ``layout``'s bytes from ``buf`` and publish them durably as shard ``name``, or as
    ``fallback`` when ``name`` is taken, never replacing a file; the report carries the name
    used, the size, checksum and chunk count for the manifest. Raises RefusedForSafety when
    every name is taken. ``writer``: one ``ckpt`` opened for ``name`` already (the save opens
    it beside its snapshot on object storage); it is this function's from then on."""
    # The staging buffer may hold accelerator tensors at aligned offsets (``Slot.host``): the
    # file's bytes are gathered from it in file order (``file_pieces``).
    data = memoryview(buf.numpy()).cast("B")[: layout.buffer_nbytes] if layout.nbytes else memoryview(b"")
    names = [name] + ([fallback] if fallback is not None else [])
    for first in range(len(names)):
        # Nearly always one pass; a second only where the backend must choose the key before
        # writing (an S3 multipart upload) and the canonical name was taken meanwhile.
        w = writer if first == 0 and writer is not None else ckpt.open_writer(names[first])
        try:
            header, chunks = _write_all(w, layout, data, rank, rank_state)
            taken = w.publish(names[first + 1 :])
        except BaseException:
            w.abort()
            raise
        if taken is not None:
            checksum = file_checksum(header, (c.checksum for c in chunks if c.checksum))
            entry = FileEntry(name=names[first + taken], size=len(header) + layout.nbytes, checksum=checksum, rank=rank, chunks=len(chunks))
            return ShardReport(entry, layout.slots)
    raise RefusedForSafety(
        f"{ckpt.url}: {' and '.join(names)} already exist; rank {rank}'s shard of this save was not published",
        hint="another writer is saving this step under the same save id; stop the other job",
    )


def open_early(ckpt: Storage, name: str, layout: ShardLayout) -> Writer | None:
    """On object storage, the writer of shard ``name``, opened and told its size as soon as the
    save knows its layout (before the snapshot): its multipart upload, and the look for a killed
    writer's upload of the key before it, are created beside the snapshot instead of two round
    trips after it, before the first part of every save. ``write_shard`` takes it; a save that
    fails or is refused first drops it (``abort_quietly``). None on a local disk, where opening
    makes a file on the training thread and gains nothing."""
    if ckpt.local_path() is not None or not layout.nbytes:
        return None
    writer = ckpt.open_writer(name)
    try:
        writer.expect(layout.nbytes)
    except BaseException:
        abort_quietly(writer)
        raise
    return writer


def abort_quietly(writer: Writer | None) -> None:
    """Drop a writer a failed save opened early; the error that ended the save is the one to
    report (an upload left open is aborted by the next writer of its key, or by prune)."""
    if writer is None:
        return
    try:
        writer.abort()
    except CkptError as e:
        log.warning("could not abort the unfinished upload of a failed save: %s", e)


def _write_all(w: Writer, layout: ShardLayout, data: memoryview, rank: int, rank_state: dict) -> tuple[bytes, list[Chunk]]:
    """Every byte of the shard into ``w`` (not yet published); the header and the chunks with
    their checksums."""
    chunks = [Chunk(s.name, s.dtype, s.shape, s.offsets, s.begin, s.end, None) for s in layout.slots]
    if callable(getattr(w, "overwrite", None)):
        return _write_hashing_as_it_goes(w, chunks, layout, data, rank, rank_state)
    w.expect(layout.nbytes)  # S3: the multipart upload is created while the chunks are hashed
    chunks = [replace(c, checksum=digest(data[s.staged : s.staged + s.end - s.begin])) for c, s in zip(chunks, layout.slots)]
    header = build_header(chunks, rank=rank, rank_state=rank_state)
    w.write(header)
    for _, piece in file_pieces(data, layout, WRITE_PIECE):
        w.write(piece)
    return header, chunks


def _write_hashing_as_it_goes(
    w: Writer, chunks: list[Chunk], layout: ShardLayout, data: memoryview, rank: int, rank_state: dict
) -> tuple[bytes, list[Chunk]]:
    """Reserve the header, write the data section while hashing it, then the real header over
    the reserved bytes. Returns the header and the chunks with their checksums."""
    reserved = build_header([replace(c, checksum=_PLACEHOLDER) for c in chunks], rank=rank, rank_state=rank_state)
    w.write(reserved)
    # The chunks tile the data section, so one pass in data order hands each piece's bytes to
    # the hashers of the chunks it covers, then writes the piece while it is still cached.
    order = sorted(range(len(chunks)), key=lambda k: (chunks[k].begin, chunks[k].end))
    hashers = [Hasher() for _ in chunks]
    i = 0
    for pos, piece in file_pieces(data, layout, STREAM_PIECE):
        end = pos + len(piece)
        while i < len(order) and chunks[order[i]].begin < end:
            c = chunks[order[i]]
            hashers[order[i]].update(piece[max(c.begin, pos) - pos : min(c.end, end) - pos])
            if c.end > end:
                break  # the chunk goes on in the next piece
            i += 1
        w.write(piece)
    done = [replace(c, checksum=h.hexdigest()) for c, h in zip(chunks, hashers)]
    header = build_header(done, rank=rank, rank_state=rank_state)
    if len(header) != len(reserved):  # cannot happen while checksums are fixed-width
        raise AssertionError(f"shard header changed length ({len(reserved)} -> {len(header)} bytes)")
    w.overwrite(0, header)  # type: ignore[attr-defined]
    return header, done
