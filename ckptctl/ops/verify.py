"""``verify``: is this checkpoint whole and uncorrupted?

Levels, each including the one before:

- ``quick``: marker, manifest (and that the marker commits this manifest), every listed file
  present with the right size, every shard header parses and agrees with the manifest;
- ``checksums`` (default): every byte of every shard read once and checked against the file
  checksum and each tensor chunk's checksum, so a flipped bit is reported by tensor name;
- ``load``: also decodes every chunk as its dtype, checks that each tensor's chunks tile it
  exactly (no gap, no overlap), and that safetensors itself accepts each local shard.

Files stream through in fixed-size pieces (memory: pieces in flight, never a whole file) and
are checked in parallel. Every problem found is reported, not just the first.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

from ckptctl.errors import CheckpointError, InvalidCheckpoint, NoValidCheckpoint, NotFound
from ckptctl.format.checkpoint import iter_marked, read_committed, read_header
from ckptctl.format.checksum import Hasher, digest, file_checksum
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.storage.base import Storage

Level = Literal["quick", "checksums", "load"]
LEVELS: tuple[Level, ...] = ("quick", "checksums", "load")
PIECE = 16 << 20
THREADS = 4

Progress = Callable[[int], None]  # called with the number of bytes just read


@dataclass(frozen=True)
class Problem:
    """One thing wrong, located as precisely as it can be."""

    message: str
    file: str | None = None
    tensor: str | None = None
    byte_range: tuple[int, int] | None = None
    hint: str | None = None

    def __str__(self) -> str:
        where = [p for p in (self.file, f"tensor {self.tensor!r}" if self.tensor else None) if p]
        if self.byte_range:
            where.append(f"bytes {self.byte_range[0]}-{self.byte_range[1]}")
        return (": ".join([", ".join(where), self.message]) if where else self.message)


@dataclass
class VerifyReport:
    url: str
    level: Level
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    note: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [{**asdict(p), "text": str(p)} for p in self.problems]
        return d


def verify_checkpoint(ckpt: Storage, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Check one checkpoint at ``level``; never raises for a problem in the checkpoint itself
    (those are in the report), only for operational failures (StorageError)."""
    t0 = time.perf_counter()
    report = VerifyReport(ckpt.url, level)
    try:
        manifest, _ = read_committed(ckpt)
    except (NotFound, InvalidCheckpoint) as e:
        report.problems.append(Problem(str(e), hint=e.hint))
        return report
    report.step, report.files, report.tensors = manifest.step, len(manifest.files), len(manifest.tensors)
    headers: dict[str, ShardHeader] = {}
    for f in manifest.files:
        h = check_file(ckpt, f, manifest, report.problems)
        if h is not None:
            headers[f.name] = h
    if level != "quick":
        files = [f for f in manifest.files if f.name in headers]
        # THREADS readers in all: over files when there are many, within files when few.
        parts = max(1, THREADS // max(len(files), 1))
        with ThreadPoolExecutor(min(THREADS, max(len(files), 1))) as pool:
            results = pool.map(lambda f: stream_file(ckpt, f, headers[f.name], level, progress, parts=parts), files)
            for problems, nbytes in results:
                report.problems.extend(problems)
                report.bytes_read += nbytes
    if level == "load":
        report.problems.extend(_coverage(manifest, headers))
        report.problems.extend(_safetensors_accepts(ckpt, headers))
    report.seconds = time.perf_counter() - t0
    return report


def check_file(ckpt: Storage, f: FileEntry, manifest: Manifest, problems: list[Problem]) -> ShardHeader | None:
    """The quick checks of one listed file (present, right size, header agrees with the
    manifest); appends what is wrong to ``problems`` and returns the header when all is well."""
    info = ckpt.stat(f.name)
    if info is None:
        problems.append(Problem("missing", file=f.name, hint="a shard was deleted or never written; resume from an older checkpoint"))
        return None
    if info.kind == "link":
        problems.append(Problem("is a symlink; ckptctl never follows links inside a checkpoint", file=f.name))
        return None
    if info.size != f.size:
        problems.append(Problem(f"has {info.size} bytes, manifest says {f.size}", file=f.name, hint="the shard is truncated or was replaced"))
        return None
    try:
        h = read_header(ckpt, f.name)
    except CheckpointError as e:  # a bad header; storage trouble (exit 3) is not the checkpoint's fault
        problems.append(Problem(str(e), file=f.name, hint=e.hint))
        return None
    ok = True
    for c in h.chunks:
        t = manifest.tensors.get(c.name)
        if t is None:
            problems.append(Problem("chunk of a tensor the manifest does not list", file=f.name, tensor=c.name))
            ok = False
        elif c.dtype != t.dtype or len(c.shape) != len(t.shape) or any(o + s > g for o, s, g in zip(c.offsets, c.shape, t.shape)):
            problems.append(Problem(
                f"chunk {c.dtype}{list(c.shape)} at {list(c.offsets)} does not fit the tensor's {t.dtype}{list(t.shape)}",
                file=f.name, tensor=c.name, byte_range=(h.data_start + c.begin, h.data_start + c.end)))
            ok = False
    if len(h.chunks) != f.chunks:
        problems.append(Problem(f"header has {len(h.chunks)} chunks, manifest says {f.chunks}", file=f.name))
        ok = False
    return h if ok else None


def stream_file(
    ckpt: Storage,
    f: FileEntry,
    h: ShardHeader,
    level: Level,
    progress: Progress | None,
    sink: Callable[[memoryview], None] | None = None,
    stop: threading.Event | None = None,
    *,
    parts: int = 1,
) -> tuple[list[Problem], int]:
    """Read the file once, in pieces, hashing each chunk; the file checksum is built from the
    header bytes and the chunk digests (``format.checksum.file_checksum``).

    ``sink`` receives every piece, in order, after it was hashed (the buffer is reused, so it
    must consume the bytes before returning): ``copy_checkpoint`` writes the copy from it, so
    copying and checking read the source once. ``stop``, once set, ends the read early with
    no verdict (another file of the same copy already failed). Without a sink the file may be
    split into ``parts`` byte ranges on chunk boundaries, read and hashed in parallel (chunk
    digests are independent): one large shard is then not limited to one thread's read and
    hash rate."""
    chunks = sorted(h.chunks, key=lambda c: c.begin)
    ranges = [(0, f.size, chunks)] if sink is not None or parts <= 1 else _split(f, h, chunks, parts)
    problems: list[Problem] = []
    if len(ranges) == 1:
        scans = [_scan(ckpt, f, h, *ranges[0], level, progress, problems, sink, stop)]
    else:
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="ckptctl-verify") as pool:
            scans = list(pool.map(lambda r: _scan(ckpt, f, h, *r, level, progress, problems, None, stop), ranges))
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
    level: Level,
    progress: Progress | None,
    problems: list[Problem],
    sink: Callable[[memoryview], None] | None,
    stop: threading.Event | None,
) -> tuple[str, list[str]] | None:
    """Hash bytes ``[start, end)``: the header part (if the range has one) and each of
    ``chunks``. Returns (header digest, chunk digests), or None when ``stop`` was set."""
    decode = None
    if level == "load":
        # Only the load level needs torch; the default levels must not import it (seconds of
        # start-up in every cron `verify` and `latest`), so it is imported here, on demand.
        from ckptctl.ops.decode import decode_problem as decode
    header = Hasher()  # the bytes before the data section, as streamed
    hashers = [Hasher() for _ in chunks]
    size = min(PIECE, max(end - start, 1))
    bufs = (bytearray(size), bytearray(size))
    starts = range(start, end, PIECE)
    ci = 0
    # While one piece is hashed (and copied by ``sink``), the next is already being read: on
    # S3 that keeps a GET in flight all the time instead of alternating network and CPU.
    # The pool is left (waiting for any read still in flight) before the reader is closed.
    with ckpt.open_reader(f.name) as r, ThreadPoolExecutor(1, thread_name_prefix="ckptctl-prefetch") as ahead:

        def fetch(k: int) -> memoryview:
            pos = starts[k]
            view = memoryview(bufs[k % 2])[: min(PIECE, end - pos)]
            r.read_into(pos, view)
            return view

        pending = ahead.submit(fetch, 0) if starts else None
        for k, pos in enumerate(starts):
            assert pending is not None
            view = pending.result()
            if stop is not None and stop.is_set():
                return None
            # The other buffer is free again: the piece before this one is fully consumed.
            pending = ahead.submit(fetch, k + 1) if k + 1 < len(starts) else None
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
    return header.hexdigest(), [hh.hexdigest() for hh in hashers]


def _coverage(manifest: Manifest, headers: dict[str, ShardHeader]) -> list[Problem]:
    """Each tensor's chunks must tile it: volumes add up to its size and no two overlap."""
    by_tensor: dict[str, list[Chunk]] = {}
    for h in headers.values():
        for c in h.chunks:
            by_tensor.setdefault(c.name, []).append(c)
    problems = []
    for name, t in manifest.tensors.items():
        chunks = by_tensor.get(name, [])
        total = sum(math.prod(c.shape) for c in chunks)
        if len(chunks) != t.chunks:
            problems.append(Problem(f"{len(chunks)} chunks found, manifest says {t.chunks}", tensor=name))
        for i, a in enumerate(chunks):
            for b in chunks[i + 1 :]:
                if all(max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a.offsets, a.shape, b.offsets, b.shape)) and a.shape:
                    problems.append(Problem(f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap", tensor=name))
        if total != math.prod(t.shape):
            problems.append(Problem(f"chunks cover {total} of {math.prod(t.shape)} elements", tensor=name,
                                    hint="a rank's shard is missing from this checkpoint"))
    return problems


def _safetensors_accepts(ckpt: Storage, headers: dict[str, ShardHeader]) -> list[Problem]:
    from safetensors import SafetensorError, safe_open

    problems = []
    for name in headers:
        path = ckpt.local_path(name)
        if path is None:
            continue  # object store: our own parser above applied the same rules
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            problems.append(Problem(f"safetensors refuses the file: {e}", file=name))
    return problems


def verify_root(root: Storage, *, which: Literal["latest", "all"], level: Level = "checksums", progress: Progress | None = None) -> list[VerifyReport]:
    """Every checkpoint that has a marker, newest first (``all``), or newest first until one
    verifies (``latest``: the reports of the newer ones that failed come first). Directories
    without a marker are not checkpoints yet and are skipped."""
    reports = []
    for _, ckpt in iter_marked(root):  # lazily: --latest stops at the first that verifies
        rep = verify_checkpoint(ckpt, level, progress)
        reports.append(rep)
        if which == "latest" and rep.ok:
            break
    if not reports:
        raise NoValidCheckpoint(f"{root.url}: no committed checkpoint", hint="nothing has been saved here yet, or every save failed")
    return reports


def latest(root: Storage, level: Level = "checksums", progress: Progress | None = None) -> tuple[VerifyReport, list[VerifyReport]]:
    """The newest committed checkpoint that verifies at ``level``, and the reports of newer
    ones that did not. Raises NoValidCheckpoint when none verifies."""
    reports = verify_root(root, which="latest", level=level, progress=progress)
    if not reports[-1].ok:
        raise NoValidCheckpoint(
            f"{root.url}: none of {len(reports)} committed checkpoints verifies",
            hint="run `ckptctl verify ROOT --all` to see what is wrong with each",
        )
    return reports[-1], reports[:-1]
