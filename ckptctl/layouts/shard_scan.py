"""Checking one shard file of a ckptctl checkpoint: the quick checks of its header against
the manifest (``check_file``), and one streaming read of the file that hashes every chunk and
rebuilds the file checksum (``stream_file``).

``native_check`` runs these for every file of a checkpoint at its levels; a copy streams
through ``stream_file``'s ``sink``, so copying and checking read the source once. Memory
is the reader's ``reads_in_flight`` pieces plus one per read (``settings.VERIFY_PIECE``, or a
writer's part size when it lends its buffers), never a whole file.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ckptctl.errors import CheckpointError, NotFound
from ckptctl.format.checksum import Hasher, digest, file_checksum
from ckptctl.format.geometry import box, fits
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.shard import Chunk, ShardHeader, read_header_with
from ckptctl.format.shard_identity import header_mismatch
from ckptctl.layouts.checked import Problem
from ckptctl.progress import Progress
from ckptctl.settings import VERIFY_PIECE
from ckptctl.storage.base import Reader, Storage


def check_file(ckpt: Storage, f: FileEntry, manifest: Manifest, problems: list[Problem], *,
               keep: dict[str, Reader] | None = None) -> ShardHeader | None:
    """The quick checks of one listed file: present, a regular file of the right size, a header
    that parses, whose chunks fit the manifest's tensors, and that is the header the manifest
    committed (``format.shard_identity``), checked first. Appends what is wrong to ``problems`` and returns
    the header when all is well. Reads the header only. ``keep``: where the reader of a file
    that passes is left open, under its name, for ``stream_file`` (the caller closes it): on
    object storage the stream then sends no HEAD of its own, and reads the very version whose
    header was checked."""
    try:
        r = _opened(ckpt, f, problems)
    except CheckpointError as e:  # refused (a link) or gone meanwhile; storage trouble (exit 3) raises
        problems.append(Problem(str(e), file=f.name, hint=e.hint))
        return None
    if r is None:
        return None
    h = None
    try:
        h = _header_checked(ckpt, f, manifest, problems, r)
    finally:
        if h is not None and keep is not None:
            keep[f.name] = r
        else:
            r.close()
    return h


def _header_checked(ckpt: Storage, f: FileEntry, manifest: Manifest, problems: list[Problem],
                    r: Reader) -> ShardHeader | None:
    # On object storage one GET of up to HEADER_GUESS bytes, a second only for a longer header:
    # the file is streamed whole next (a copy, a verify), so the bytes past the header cost
    # less than a round trip. Loads and re-sharding read headers without it (``read_header``):
    # they read only the regions they need, and a guess per header would read more than those.
    try:
        h = read_header_with(r.read, r.size, ckpt.url_of(f.name), guess=r.reads_are_requests)
    except CheckpointError as e:  # a bad header; storage trouble (exit 3) is not the checkpoint's fault
        problems.append(Problem(str(e), file=f.name, hint=e.hint))
        return None
    # The header is bound to the manifest before any field of it is believed: a header that
    # is not the committed one says nothing trustworthy about its chunks.
    why = header_mismatch(h, f)
    if why is not None:
        problems.append(Problem(why, file=f.name, byte_range=(0, h.data_start),
                                hint="the shard is corrupt, belongs to another save or was modified after commit; resume from an older checkpoint"))
        return None
    ok = True
    for c in h.chunks:
        t = manifest.tensors.get(c.name)
        if t is None:
            problems.append(Problem("chunk of a tensor the manifest does not list", file=f.name, tensor=c.name))
            ok = False
        elif c.dtype != t.dtype or not fits(box(c.offsets, c.shape), t.shape):
            problems.append(Problem(
                f"chunk {c.dtype}{list(c.shape)} at {list(c.offsets)} does not fit the tensor's {t.dtype}{list(t.shape)}",
                file=f.name, tensor=c.name, byte_range=(h.data_start + c.begin, h.data_start + c.end)))
            ok = False
    if len(h.chunks) != f.chunks:
        problems.append(Problem(f"header has {len(h.chunks)} chunks, manifest says {f.chunks}", file=f.name))
        ok = False
    return h if ok else None


def _opened(ckpt: Storage, f: FileEntry, problems: list[Problem]) -> Reader | None:
    """``f``'s file opened, when it is a regular file of the size the manifest says; else None,
    with what is wrong appended to ``problems``. On object storage the open's own HEAD says
    present and its size (a stat first was one more request in series, before every copy and
    verify of a file); only when it finds nothing does a stat say what is there instead (nothing,
    or keys below the name). Locally a stat first, so that a link is refused, never opened."""
    if ckpt.local_path() is None:
        try:
            r = ckpt.open_reader(f.name)
        except NotFound:
            r = None
        if r is not None and r.size == f.size:
            return r
        if r is not None:
            r.close()
            problems.append(_size_problem(f, r.size))
            return None
    info = ckpt.stat(f.name)
    if info is None:
        problems.append(Problem("missing", file=f.name, hint="a shard was deleted or never written; resume from an older checkpoint"))
        return None
    if info.kind == "link":
        problems.append(Problem("is a symlink; ckptctl never follows links inside a checkpoint", file=f.name))
        return None
    if info.size != f.size:
        problems.append(_size_problem(f, info.size))
        return None
    return ckpt.open_reader(f.name)


def _size_problem(f: FileEntry, size: int) -> Problem:
    return Problem(f"has {size} bytes, manifest says {f.size}", file=f.name, hint="the shard is truncated or was replaced")


def stream_file(
    ckpt: Storage,
    f: FileEntry,
    h: ShardHeader,
    progress: Progress | None = None,
    *,
    decode: bool = False,
    sink: Callable[[memoryview], None] | None = None,
    stop: threading.Event | None = None,
    parts: int = 1,
    spare: Callable[[int], memoryview | None] | None = None,
    piece: int | None = None,
    reader: Reader | None = None,
) -> tuple[list[Problem], int]:
    """Read the file once, in pieces, hashing each chunk; the file checksum is built from the
    header bytes and the chunk digests (``format.checksum.file_checksum``).

    ``sink`` receives every piece, in order, after it was hashed (the buffer is reused, so it
    must consume the bytes before returning): ``copy_checkpoint`` writes the copy from it, so
    copying and checking read the source once. With ``spare``, each piece is read into the
    memory ``spare(n)`` returns, when it returns any (a writer's own part buffers:
    ``S3Writer.spare``), and ``sink`` keeps it, so the piece is not copied again on its way
    out; ``piece``, the bytes read at a time, is then the size the writer lends (its part
    size). ``stop``, once set, ends the read early with no verdict (another file of the same
    copy already failed). Without a sink the file may be
    split into ``parts`` byte ranges on chunk boundaries, read and hashed in parallel (chunk
    digests are independent): one large shard is then not limited to one thread's read and
    hash rate. ``decode`` also checks that every chunk decodes as its dtype (verify's
    ``load`` level). ``reader``: the file already open (``check_file``'s ``keep``), read through
    and left open; else each range opens its own."""
    chunks = sorted(h.chunks, key=lambda c: c.begin)
    ranges = [(0, f.size, chunks)] if sink is not None or parts <= 1 else _split(f, h, chunks, parts)
    problems: list[Problem] = []
    if len(ranges) == 1:
        scans = [_scan(ckpt, f, h, *ranges[0], decode, progress, problems, sink, stop, spare, piece, reader)]
    else:
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="ckptctl-verify") as pool:
            scans = list(pool.map(lambda r: _scan(ckpt, f, h, *r, decode, progress, problems, None, stop, None, None, reader),
                                  ranges))
    if any(s is None for s in scans):  # stopped early: no verdict
        return problems, 0
    header = scans[0][0]
    digests = [d for _, ds in scans for d in ds]  # type: ignore[misc]
    # The header was parsed from an earlier read: the streamed bytes must be the same ones.
    if file_checksum(h.header_bytes, digests) != f.checksum or header != digest(h.header_bytes):
        problems.append(Problem("file checksum does not match the manifest", file=f.name, byte_range=(0, f.size),
                                hint="the shard was modified after it was written; resume from an older checkpoint"))
    for c, d in zip(chunks, digests):
        if c.checksum is not None and d != c.checksum:
            problems.append(Problem("data does not match its checksum", file=f.name, tensor=c.name,
                                    byte_range=(h.data_start + c.begin, h.data_start + c.end)))
    return problems, f.size


def _split(f: FileEntry, h: ShardHeader, chunks: list[Chunk], parts: int) -> list[tuple[int, int, list[Chunk]]]:
    """Up to ``parts`` contiguous byte ranges of about equal size, cut between chunks. The
    first range starts at 0 so that it also reads the header."""
    target = max(1, f.size // parts)
    ranges: list[tuple[int, int, list[Chunk]]] = []
    start, group = 0, []
    for c in chunks:
        group.append(c)
        end = h.data_start + c.end
        if end - start >= target and len(ranges) < parts - 1:
            ranges.append((start, end, group))
            start, group = end, []
    ranges.append((start, f.size, group))
    return ranges


def _scan(
    ckpt: Storage,
    f: FileEntry,
    h: ShardHeader,
    start: int,
    end: int,
    chunks: list[Chunk],
    decode_chunks: bool,
    progress: Progress | None,
    problems: list[Problem],
    sink: Callable[[memoryview], None] | None,
    stop: threading.Event | None,
    spare: Callable[[int], memoryview | None] | None = None,
    piece: int | None = None,
    reader: Reader | None = None,
) -> tuple[str, list[str]] | None:
    """Hash bytes ``[start, end)``: the header part (if the range has one) and each of
    ``chunks``. Returns (header digest, chunk digests), or None when ``stop`` was set."""
    decode = None
    if decode_chunks:
        # Only the load level needs torch; the default levels must not import it (seconds of
        # start-up in every cron `verify` and `latest`), so it is imported here, on demand.
        from ckptctl.layouts.decode import decode_problem as decode
    header = Hasher()  # the bytes before the data section, as streamed
    hashers = [Hasher() for _ in chunks]
    piece = piece or VERIFY_PIECE
    size = min(piece, max(end - start, 1))
    starts = range(start, end, piece)
    ci = 0
    # While one piece is hashed (and copied by ``sink``), the next ``depth`` are being read:
    # locally one (the kernel reads ahead of it); on S3 several GETs, since one connection
    # moves 50-100 MB/s and a store's throughput comes from many (``Reader.reads_in_flight``).
    # Reads may finish in any order; pieces are consumed in order. The pool is left (reads not
    # yet started cancelled, those in flight waited for) before the reader is closed.
    with nullcontext(reader) if reader is not None else ckpt.open_reader(f.name) as r:
        depth = max(1, min(r.reads_in_flight, len(starts)))
        # The scan's own buffers, one per piece in flight plus the one being consumed, taken in
        # turn; with ``spare``, made only for a piece the sink lends no memory for (the short
        # last one), and only as large as it.
        bufs = [bytearray(size if spare is None else 0) for _ in range(depth + 1)]

        def fetch(k: int) -> memoryview:
            pos = starts[k]
            n = min(piece, end - pos)
            view = spare(n) if spare is not None else None
            if view is None:
                if len(bufs[k % len(bufs)]) < n:
                    bufs[k % len(bufs)] = bytearray(n)
                view = memoryview(bufs[k % len(bufs)])[:n]
            r.read_into(pos, view)
            return view

        ahead = ThreadPoolExecutor(depth, thread_name_prefix="ckptctl-prefetch")
        try:
            pending = deque(ahead.submit(fetch, k) for k in range(depth if starts else 0))
            for k, pos in enumerate(starts):
                view = pending.popleft().result()
                if stop is not None and stop.is_set():
                    return None
                # Piece k's buffer is not among those read into next: k + 1 .. k + depth.
                if k + depth < len(starts):
                    pending.append(ahead.submit(fetch, k + depth))
                n = len(view)
                if pos < h.data_start:
                    header.update(view[: h.data_start - pos])
                # Hand each part of the piece to the chunk it belongs to (the header is no chunk's).
                lo, hi = pos, pos + n
                while ci < len(chunks):
                    c = chunks[ci]
                    cb, ce = h.data_start + c.begin, h.data_start + c.end
                    a, b = max(lo, cb), min(hi, ce)
                    if a < b:
                        part = view[a - pos : b - pos]
                        hashers[ci].update(part)
                        if decode is not None:
                            bad = decode(part, c.dtype, a - cb)
                            if bad is not None:
                                problems.append(Problem(bad, file=f.name, tensor=c.name))
                    if ce <= hi:
                        ci += 1
                    else:
                        break
                if sink is not None:
                    sink(view)
                if progress:
                    progress(n)
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)
    return header.hexdigest(), [hh.hexdigest() for hh in hashers]
