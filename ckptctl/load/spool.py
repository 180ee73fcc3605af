"""Fetching what a load needs from object storage once: a local spool of remote byte ranges.

An all-or-nothing load with no host memory lent to it (``load.into_state``: ``load_checkpoint``
called directly, ``load_latest(prepare=False)``; with memory, ``load.staged`` reads each byte
once) reads every chunk it needs twice: a first pass hashes them all, changing no target, and
only then a second pass fills the targets. On a local file the second read comes from the page
cache. From object storage it would fetch every byte twice, one ranged GET per chunk per pass.
So the chunks of every file without a
local descriptor (``Reader.local_fd()`` None: S3, or a tier view's files that are not on this
node) are fetched once into a temporary local file, adjacent chunks of one file in one GET of
up to ``settings.VERIFY_PIECE``, and both passes read them from there:

- the first pass hashes the spooled bytes: nothing is applied unless they match;
- the fill pass hashes what it reads again as it reads it, as it does from any storage, so
  a byte it uses is a verified byte even if the spool's disk flips one in between.

Memory stays one piece buffer per fetching thread; disk holds the bytes this rank reads (its
share, not the checkpoint). The file is unlinked as soon as it is made, so it is gone on
``close`` or when the process dies, whatever happens in between. When it cannot be made or
filled (a full disk, a quota, an unwritable directory), ``spool_remote`` logs a warning and
returns None: the load then reads from storage twice, as before, and never fails for that.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ckptctl.load.shard_index import Located
from ckptctl.settings import IO_THREADS, VERIFY_PIECE
from ckptctl.storage.base import Reader, byte_view
from ckptctl.storage.local_io import LocalReader

log = logging.getLogger("ckptctl")

# fallocate's answers meaning "this filesystem cannot reserve space": the writes still tell.
_NO_RESERVE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class SpoolUnavailable(Exception):
    """The spool's own file could not be made or written (its disk, not the checkpoint)."""


@dataclass(frozen=True)
class Piece:
    """Bytes ``[lo, hi)`` of ``file``, kept at ``at`` in the spool."""

    file: str
    lo: int
    hi: int
    at: int


def coalesce(ranges: Iterable[tuple[str, int, int]], cap: int = VERIFY_PIECE) -> list[Piece]:
    """``(file, lo, hi)`` ranges merged where they touch or overlap within a file, then cut
    into pieces of at most ``cap`` bytes (one ranged GET each), laid end to end in the spool."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, lo, hi in ranges:
        if hi > lo:
            by_file.setdefault(file, []).append((lo, hi))
    pieces: list[Piece] = []
    at = 0
    for file in sorted(by_file):
        runs: list[list[int]] = []
        for lo, hi in sorted(by_file[file]):
            if runs and lo <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        for lo, hi in runs:
            for a in range(lo, hi, cap):
                b = min(a + cap, hi)
                pieces.append(Piece(file, a, b, at))
                at += b - a
    return pieces


class Spool:
    """A temporary local file (in ``directory``, default ``$TMPDIR``) holding copies of byte
    ranges of remote files; ``read_into`` serves a range it holds. Close it to free the disk."""

    def __init__(self, directory: str | None = None) -> None:
        try:
            fd, path = tempfile.mkstemp(prefix="ckptctl-load-", suffix=".spool", dir=directory)
        except OSError as e:
            raise SpoolUnavailable(f"cannot create a spool file in {directory or tempfile.gettempdir()}: {e}") from e
        try:
            os.unlink(path)  # only the descriptor keeps it: no file is left behind, ever
        except OSError as e:
            os.close(fd)
            raise SpoolUnavailable(f"cannot unlink the spool file {path}: {e}") from e
        self.where = directory or tempfile.gettempdir()
        self._file = LocalReader(fd, f"spool in {self.where}")  # its reads: loops, short-read checks
        self._fd = fd
        self._index: dict[str, list[Piece]] = {}
        self._starts: dict[str, list[int]] = {}  # each file's pieces' ``lo``, for bisect
        self._local = threading.local()

    def fetch(self, pieces: Sequence[Piece], reader: Callable[[str], Reader], threads: int = IO_THREADS) -> None:
        """Copy every piece from ``reader(piece.file)`` into the spool, ``threads`` at a time.
        ``SpoolUnavailable`` when the spool's disk refuses the bytes; storage errors as raised.
        Once per spool: ``coalesce`` lays every set of pieces out from offset 0."""
        if self._index:
            raise ValueError("Spool.fetch: this spool is already filled")
        total = sum(p.hi - p.lo for p in pieces)
        try:
            # Reserve it all first: a full disk shows before the first GET, not after most of them.
            os.posix_fallocate(self._fd, 0, total)
        except OSError as e:
            if e.errno not in _NO_RESERVE:
                raise SpoolUnavailable(f"cannot reserve {total} bytes in {self.where}: {e}") from e
        if len(pieces) <= 1 or threads <= 1:
            for p in pieces:
                self._fetch(p, reader)
        else:
            with ThreadPoolExecutor(min(threads, len(pieces))) as pool:
                for f in [pool.submit(self._fetch, p, reader) for p in pieces]:
                    f.result()
        for p in pieces:  # indexed only once every piece is in: no read sees a hole
            self._index.setdefault(p.file, []).append(p)
        for file, held in self._index.items():
            held.sort(key=lambda p: p.lo)
            self._starts[file] = [p.lo for p in held]

    def _fetch(self, p: Piece, reader: Callable[[str], Reader]) -> None:
        n = p.hi - p.lo
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(n)
        view = memoryview(buf)[:n]
        reader(p.file).read_into(p.lo, view)
        done = 0
        try:
            while done < n:
                done += os.pwrite(self._fd, view[done:], p.at + done)
        except OSError as e:
            raise SpoolUnavailable(f"cannot write {n} bytes to the spool in {self.where}: {e}") from e

    def read_into(self, file: str, offset: int, out: memoryview) -> bool:
        """Fill ``out`` with bytes ``offset..`` of ``file`` from the spool when it holds them
        all (True; a chunk larger than a piece spans several pieces of one run); False when
        it does not: the caller then reads the storage, over anything written to ``out``."""
        held = self._index.get(file)
        if not held:
            return False
        view = byte_view(out)
        k = bisect.bisect_right(self._starts[file], offset) - 1
        pos, done = offset, 0
        while done < len(view):
            if k < 0 or k >= len(held) or not held[k].lo <= pos < held[k].hi:
                return False
            n = min(held[k].hi - pos, len(view) - done)
            self._file.read_into(held[k].at + pos - held[k].lo, view[done : done + n])
            pos, done, k = pos + n, done + n, k + 1
        return True

    def close(self) -> None:
        """Free the spool's disk (the file was unlinked at creation). Idempotent."""
        self._index, self._starts = {}, {}
        self._file.close()

    def __enter__(self) -> "Spool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spool_remote(locs: Sequence[Located], reader: Callable[[str], Reader], directory: str | None = None) -> Spool | None:
    """A spool holding every chunk of ``locs`` whose file is not local (``reader(file)``'s
    ``local_fd()`` is None), fetched once, coalesced; None when every file is local, or when
    the spool cannot hold them (a warning says why; the caller reads the storage instead)."""
    files = sorted({loc.file for loc in locs})
    if len(files) > 1:
        with ThreadPoolExecutor(min(IO_THREADS, len(files))) as pool:
            opened = list(pool.map(reader, files))  # a HEAD each on S3: opened in parallel
    else:
        opened = [reader(f) for f in files]
    remote = {f for f, r in zip(files, opened) if r.local_fd() is None}
    pieces = coalesce((loc.file, *loc.byte_range) for loc in locs if loc.file in remote)
    if not pieces:
        return None
    spool: Spool | None = None
    done = False
    try:
        spool = Spool(directory)
        spool.fetch(pieces, reader)
        done = True
    except SpoolUnavailable as e:
        log.warning("load: %s; reading the %d bytes needed twice from storage instead "
                    "(point TMPDIR at a local disk with room to fetch them once)",
                    e, sum(p.hi - p.lo for p in pieces))
    finally:
        if not done and spool is not None:
            spool.close()  # a full disk or a storage error: free the disk first
    return spool if done else None
