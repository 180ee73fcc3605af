"""Copying files of one checkpoint, the one way every copy does it (``ops.transfer.engine``
for a whole checkpoint, ``tiers.upload`` for one rank's shards, ``ops.transfer.node_restore``
for one node's): each file streamed once from the source, checked on the way against what its
layout says proves it (``layouts.base.ToCopy.proof``: the manifest's chunk and file checksums,
a seal's digests, or nothing), written from the same pieces, and published only where nothing
has its name (``Writer.publish``: a hard link locally, ``If-None-Match: *`` on S3). A name
already taken is used as it is when it holds exactly this file's bytes, proven the same way
by reading it back (an interrupted copy run again, a retried promotion round: they resume
instead of uploading again); otherwise the copy is refused for safety, and nothing is
replaced (``docs/protocol.md``, "Every writer of a step").

Memory: ``threads`` files at once, each holding its reader's pieces in flight (locally two of
16 MiB; from S3 ``read_concurrency + 1``: 144 MiB by default) plus what its writer buffers (on
S3, up to ``max_inflight_parts + 1`` parts of 8 MiB: 136 MiB by default); never a whole file.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Sequence, TypeVar

from ckptctl.errors import CheckpointError, RefusedForSafety, StorageError
from ckptctl.format.shard import ShardHeader
from ckptctl.layouts.copying import ByManifest, BySeal, ToCopy
from ckptctl.progress import expect_bytes
from ckptctl.layouts.seal_check import compare, hash_object
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS, VERIFY_PIECE
from ckptctl.storage.base import Reader, Storage, Writer

T = TypeVar("T")


def describe_problems(problems: list[Problem], where: str) -> str:
    # The most precise problem first: a tensor and byte range say more than "file checksum".
    first = min(problems, key=lambda p: (p.tensor is None, p.byte_range is None))
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {first}{more}"


@dataclass(frozen=True)
class Ends:
    """Where one copy reads and writes: the source checkpoint, the copy's checkpoint at the
    destination and its root. A checkpoint that is one file (``ToCopy.name`` "") is read from
    the storage rooted at it and written into ``dst_root`` under ``name``."""

    src: Storage
    dst: Storage
    dst_root: Storage | None = None
    name: str = ""

    def at(self, item: ToCopy) -> tuple[Storage, str]:
        """The storage and key ``item`` is written to."""
        if item.name:
            return self.dst, item.name
        assert self.dst_root is not None, "a one-file checkpoint is written into its root"
        return self.dst_root, self.name


@dataclass
class Copied:
    """What ``copy_files`` did: the problems found, by file (nothing was published for those),
    the files it published (the only ones this copy may ever delete) and the ones in place."""

    problems: dict[str, list[Problem]] = field(default_factory=dict)
    before_copy: bool = False  # the problems were found by the header checks, before any copying
    published: list[str] = field(default_factory=list)
    files: int = 0
    reused: int = 0
    bytes_copied: int = 0


def copy_files(ends: Ends, files: Sequence[ToCopy], progress: Progress | None = None, *,
               threads: int = COPY_THREADS, before_writing: Callable[[], object] | None = None,
               taken: Collection[str] | None = None) -> Copied:
    """Copy ``files`` from ``ends.src`` to ``ends.dst``, each checked against its proof as it
    streams and published only where nothing has its name; a file already there holding
    exactly its proven bytes is kept. Headers are checked first, all of them (in parallel: on
    S3 each costs a HEAD and a ranged GET), so a bad one stops the copy before a byte is copied.
    ``before_writing`` (``ops.transfer.uploads.before_copy``) runs beside those checks and the
    listing of the destination, and is over before any file's writer opens: on S3 each is a
    request the first part would otherwise wait for, one after the other. ``taken``: the keys
    the destination held when the copy began (``first_look``), instead of that listing.
    Writes no commit record. Raises RefusedForSafety (a name holds other bytes: never
    replaced) and StorageError."""
    # On object storage each file's reader stays open from its header's check to its stream:
    # one HEAD per file, not two (locally a descriptor per file would be held meanwhile).
    kept: dict[str, Reader] | None = {} if ends.src.local_path() is None else None
    try:
        return _checked_then_copied(ends, files, progress, threads, taken, before_writing, kept)
    finally:
        for reader in (kept or {}).values():
            reader.close()


def _checked_then_copied(ends: Ends, files: Sequence[ToCopy], progress: Progress | None, threads: int,
                         taken: Collection[str] | None, before_writing: Callable[[], object] | None,
                         kept: dict[str, Reader] | None) -> Copied:
    """``copy_files``, its readers kept open in ``kept`` (when given) and closed by the caller."""
    out = Copied(files=len(files))
    headers: dict[str, ShardHeader] = {}
    with ThreadPoolExecutor(max(1, threads) + 2, thread_name_prefix="ckptctl-check") as pool:
        cleared = pool.submit(before_writing) if before_writing is not None else None
        listed = pool.submit(names_there, ends, files) if taken is None else None
        for item, (h, found) in zip(files, pool.map(lambda item: _header(ends.src, item, kept), files)):
            if found:
                out.problems[item.name] = found
            if h is not None:
                headers[item.name] = h
    if cleared is not None:
        cleared.result()
    if out.problems:
        out.before_copy = True
        return out
    there = set(taken) if listed is None else listed.result()  # after the verdict on the headers
    expect_bytes(progress, sum(f.size for f in files))  # a bar's total, %, ETA
    stop = threading.Event()  # one corrupt or failed file ends the others early

    def one(item: ToCopy) -> tuple[list[Problem], str]:
        try:
            return _copy_one(ends, item, ends.at(item)[1] in there, headers.get(item.name), progress, stop, kept)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptctl-copy") as pool:
        futures: list[Future[tuple[list[Problem], str]]] = [pool.submit(one, f) for f in files]
        try:
            wait(futures)
        except BaseException:
            stop.set()  # Ctrl-C: workers abort their writers at the next piece instead of finishing
            for future in futures:
                future.cancel()
            raise
    for item, future in zip(files, futures):
        found, what = future.result()  # a storage error, refusal or interrupt in any worker surfaces here
        if found:
            out.problems[item.name] = found
        elif what == "published":
            out.published.append(ends.at(item)[1])
            out.bytes_copied += item.size
        elif what == "reused":
            out.reused += 1
    return out


def _header(src: Storage, item: ToCopy, kept: dict[str, Reader] | None) -> tuple[ShardHeader | None, list[Problem]]:
    """The header a file proven by a manifest must have, checked against it before copying
    (its reader left in ``kept``, when given, for the stream)."""
    if not isinstance(item.proof, ByManifest):
        return None, []
    found: list[Problem] = []
    return check_file(src, item.proof.entry, item.proof.manifest, found, keep=kept), found


def names_there(ends: Ends, files: Sequence[ToCopy]) -> set[str]:
    """The keys the destination already has among those ``files`` are written to: one listing
    of the copy's directory (a stat for a one-file checkpoint), not a request per file."""
    if not files:
        return set()
    with _at_destination(ends.dst):
        if any(not f.name for f in files):
            where, key = ends.at(files[0])
            return {key} if where.stat(key) is not None else set()
        return {info.key for info in ends.dst.list()}


def _copy_one(ends: Ends, item: ToCopy, taken: bool, header: ShardHeader | None, progress: Progress | None,
              stop: threading.Event, kept: dict[str, Reader] | None = None) -> tuple[list[Problem], str]:
    """One file: ([], "published"), ([], "reused"), (problems, "") or ([], "") when stopped.
    ``taken``: the destination listed its name already."""
    where, key = ends.at(item)
    if taken:
        return _reuse(ends, item, progress)
    with _at_destination(ends.dst):
        writer = where.open_writer(key)
    try:
        writer.expect(item.size)
        found = _stream(ends.src, item, header, progress, writer, stop, kept)
    except BaseException:
        writer.abort()
        raise
    if found is None or found or stop.is_set():
        writer.abort()
        return found or [], ""
    try:
        with _at_destination(ends.dst):
            got = writer.publish()
    except RefusedForSafety:  # S3: another writer of this object superseded our upload
        got = None
    if got == 0:
        return [], "published"
    return _reuse(ends, item, None)  # taken meanwhile: by this very file (a twin copy), or refused


def _reuse(ends: Ends, item: ToCopy, progress: Progress | None) -> tuple[list[Problem], str]:
    """A name that is taken: kept when it holds exactly ``item``'s proven bytes, else refused."""
    where, key = ends.at(item)
    with _at_destination(ends.dst):
        proven = proven_at(ends, item)
    if not proven:
        raise RefusedForSafety(
            f"{where.url_of(key)} already exists and does not hold this checkpoint's bytes: another writer is "
            "writing this step (or a killed one left it); nothing was replaced and nothing committed",
            hint=f"let the other writer finish; if none is running, remove the partial copy "
            f"(`ckptctl rm {ends.dst.url} --force`, or prune's --partial-after) and copy again",
        )
    if progress is not None:
        progress(item.size)
    return [], "reused"


def _stream(src: Storage, item: ToCopy, header: ShardHeader | None, progress: Progress | None,
            writer: Writer, stop: threading.Event, kept: dict[str, Reader] | None = None) -> list[Problem] | None:
    """Read ``item`` once from ``src`` into ``writer``, checking it against its proof; the
    problems found, or None when ``stop`` was set meanwhile (no verdict)."""
    proof = item.proof
    sink = writer.write
    if isinstance(proof, ByManifest):
        assert header is not None
        # An S3 writer lends its part buffers: each piece, of the part size, is read into one,
        # checked there and becomes a part as it is, instead of being copied into one.
        hand_over, spare = getattr(writer, "hand_over", None), getattr(writer, "spare", None)
        lends = callable(hand_over) and callable(spare)
        found, _ = stream_file(src, proof.entry, header, progress, sink=hand_over if lends else sink, stop=stop,
                               spare=spare if lends else None,
                               piece=getattr(writer, "spare_size", None) if lends else None,
                               reader=(kept or {}).get(proof.entry.name))
        return None if stop.is_set() else found
    if isinstance(proof, BySeal):
        got = hash_object(src, item.name, proof.chunk_size, progress=progress, sink=sink, stop=stop)
        return None if got is None else compare(proof.sealed, got, proof.chunk_size)
    with _reader(src, item.name) as r:
        for offset in range(0, r.size, VERIFY_PIECE):
            if stop.is_set():
                return None
            piece = r.read(offset, min(VERIFY_PIECE, r.size - offset))
            sink(memoryview(piece))
            if progress is not None:
                progress(len(piece))
    return []


def proven_at(ends: Ends, item: ToCopy) -> bool:
    """Whether the destination's ``item`` holds exactly the bytes its proof describes (read
    back in full: by the manifest, by the seal, or byte for byte against the source)."""
    where, key = ends.at(item)
    info = where.stat(key)
    if info is None or info.kind != "file" or info.size != item.size:
        return False
    proof = item.proof
    if isinstance(proof, ByManifest):
        found: list[Problem] = []
        h = check_file(where, proof.entry, proof.manifest, found)
        return h is not None and not stream_file(where, proof.entry, h)[0]
    if isinstance(proof, BySeal):
        got = hash_object(where, key, proof.chunk_size)
        return got is not None and not compare(proof.sealed, got, proof.chunk_size)
    with _reader(ends.src, item.name) as a, where.open_reader(key) as b:
        if a.size != b.size:
            return False
        return all(a.read(o, n) == b.read(o, n) for o in range(0, a.size, VERIFY_PIECE)
                   for n in [min(VERIFY_PIECE, a.size - o)])


def _reader(st: Storage, key: str) -> Reader:
    return st.open_reader(key) if key else st.open_root_reader()


def at_destination(dst: Storage, fn: Callable[[], T]) -> T:
    """``fn()`` under ``_at_destination``: inside ``ops.distributed.attempt``, so that the error
    every rank agrees on is already the destination's (exit 3), as a plain run's is."""
    with _at_destination(dst):
        return fn()


@contextmanager
def _at_destination(dst: Storage) -> Iterator[None]:
    """A checkpoint problem raised by the destination's storage (a symlinked step directory,
    a file where a directory belongs) is an operational error naming DST (exit 3): never a
    reason to skip a good source and restore an older step instead."""
    try:
        yield
    except RefusedForSafety:
        raise
    except CheckpointError as e:
        raise StorageError(
            f"{dst.url}: the destination cannot be written: {e}",
            hint="fix or remove it (ckptctl never follows links or writes through them), then run again",
        ) from None
