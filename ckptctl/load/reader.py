"""Reading tensors, or regions of them, out of a committed checkpoint, verifying every byte used.

Opening a checkpoint (``CheckpointReader``) reads its marker and manifest; a shard header is
read when a read needs that shard (the manifest's placement hints say which shards hold which
block of a tensor, see ``man/ckptctl-format.5``), and each header is bound to the manifest: the file checksum the manifest records is rebuilt from
the header bytes and the chunk checksums in the header (``format.checksum.file_checksum``), so
a shard copied in from another save, or a header edited after commit, is refused before any
data is read. Every chunk read is then checked against its chunk checksum, which chains the
data to the marker: marker -> manifest -> file checksum -> header -> chunk checksum -> bytes.

Reads are by *chunk*, the region of a tensor one shard holds. A target region (a whole tensor,
or the part a rank holds after re-sharding) is filled from every chunk that overlaps it
(``load.fill``):

- a chunk the target needs whole, and whose elements are one contiguous run of the target
  (same sharding, or whole rows of it), is read straight into the target and hashed there:
  no copy;
- a chunk the target needs part of is still read whole, because its checksum covers all of
  it: the needed rows go straight into place when they are contiguous in the target, the rest
  streams through one bounded piece buffer only to be hashed; other layouts (column splits)
  stream every row through the piece buffer and copy the needed columns out of it. The extra
  bytes read are at most one chunk per edge of the target, and memory is one piece.

A mismatch raises ``InvalidCheckpoint`` naming the file, tensor and byte range; the target may
then hold some bytes of the bad chunk, so a caller falls back and overwrites it
(``Checkpointer.load_latest`` does). The same code serves loading at a different world size,
``convert`` and offline ``reshard``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes
from ckptctl.format.checksum import Hasher, digest
from ckptctl.format.geometry import intersection
from ckptctl.load.bounce import BouncePool
from ckptctl.load.fill import VERIFY_PIECE, check_covered, check_target, fill_target
from ckptctl.load.shard_index import Located, ReadJob, ShardIndex, file_runs, region_of
from ckptctl.load.spool import Spool, spool_remote
from ckptctl.settings import IO_THREADS, READ_STEP, SEQUENTIAL_RUN
from ckptctl.storage.base import Reader, Storage


class CheckpointReader(ShardIndex):
    """Open one committed checkpoint: its marker and manifest, and shard headers on demand,
    each header bound to the manifest by its file checksum (``InvalidCheckpoint`` otherwise).

    A read opens only the headers of the shards that can hold the region it fills, by the
    manifest's placement hints (``load.shard_index``): a rank loading its FSDP shard opens
    one or two headers, not every rank's. ``headers`` (file name -> ``ShardHeader``) opens
    them all; ``headers_read`` counts the headers opened so far.

    ``chunks(name)``/``locate(name, box)`` say where a tensor's bytes are;
    ``read_into``/``read_many`` fill targets, ``read_chunk``/``stream_chunk`` hand out whole
    chunks; all of them verify what they read. Close it (or use it as a context manager) to
    release open files.

    >>> with CheckpointReader(open_storage("/ckpt/step-0000001000")) as r:  # doctest: +SKIP
    ...     w = r.read("model/fc.weight")
    """

    def __init__(self, ckpt: Storage, *, verify_checksums: bool = True, spool_dir: str | None = None) -> None:
        super().__init__(ckpt, verify_checksums=verify_checksums)
        self._readers: dict[str, Reader] = {}
        self.spool_dir = spool_dir  # for verify_many's spool ($TMPDIR when None)
        self._spool: Spool | None = None
        self._local = threading.local()
        self._bounce: dict[torch.device, BouncePool] = {}  # GPU devices of the read_many in flight

    # --- whole chunks -----------------------------------------------------------------------

    def read_chunk(self, loc: Located, out: memoryview | None = None) -> memoryview:
        """The bytes of chunk ``loc``, checked against its checksum; into ``out`` (exactly the
        chunk's size) when given, else into a new buffer."""
        n = loc.chunk.end - loc.chunk.begin
        view = out if out is not None else memoryview(bytearray(n))
        if len(view) != n:
            raise ValueError(f"read_chunk: buffer of {len(view)} bytes for a chunk of {n}")
        self.pread(loc.file, loc.byte_range[0], view)
        self.check_digest(loc, digest(view))
        return view

    def stream_chunk(self, loc: Located, piece_bytes: int = VERIFY_PIECE) -> Iterator[memoryview]:
        """The bytes of chunk ``loc`` in order, in pieces of at most ``piece_bytes`` (each valid
        until the next is asked for). After the last piece the chunk's checksum is checked and
        ``InvalidCheckpoint`` raised on a mismatch: consume the iterator to its end before
        trusting anything computed from the pieces."""
        start, end = loc.byte_range
        buf = memoryview(bytearray(min(max(piece_bytes, 1), max(end - start, 1))))
        h = Hasher()
        for pos in range(start, end, len(buf)):
            view = buf[: min(len(buf), end - pos)]
            self.pread(loc.file, pos, view)
            h.update(view)
            yield view
        self.check_digest(loc, h.hexdigest())

    # --- regions ----------------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """The whole global tensor, newly allocated, verified."""
        t = self.tensor(name)
        out = torch.empty(t.shape, dtype=dtypes.torch_dtype(t.dtype))
        self.read_into(ReadJob(name, out))
        return out

    def read_many(self, jobs: Sequence[ReadJob]) -> None:
        """Fill many targets, verified, in parallel (ranged reads and hashing release the GIL).
        The headers they need are opened first, in parallel, once."""
        self.prefetch(jobs)
        # GPU targets: verified host bytes go up through a few reusable pinned buffers, their
        # copies queued on this (the caller's) thread's current stream, so they are ordered
        # against the caller's kernels, not the I/O threads' default streams (load.bounce).
        devices = {j.target.device for j in jobs if j.target.device.type == "cuda"}
        self._bounce = {d: BouncePool(d) for d in devices}
        try:
            if len(jobs) <= 1:
                for j in jobs:
                    self.read_into(j)
                return
            with ThreadPoolExecutor(IO_THREADS) as pool:
                for f in [pool.submit(self.read_into, j) for j in jobs]:
                    f.result()
        finally:
            bounce, self._bounce = self._bounce, {}
            for b in bounce.values():
                b.close()  # waits for the queued copies: the tensors are loaded on return
            self._drop_spool()  # it served this fill

    def verify_many(self, jobs: Sequence[ReadJob]) -> int:
        """Read and hash every chunk that ``read_many(jobs)`` would read from, changing no
        target: the first half of an all-or-nothing load (``load.into_state``). Raises what
        ``read_many`` would (``StateError`` for a target that does not fit, ``InvalidCheckpoint``
        for a chunk that fails its checksum or a region the chunks do not cover) before any
        target is written. Each chunk is hashed once however many jobs overlap it, in parallel:
        adjacent chunks of a file as runs of up to ``SEQUENTIAL_RUN``, each read front to back
        through one ``READ_STEP`` buffer per thread (the kernel reads ahead of each run). Returns
        the bytes hashed. Chunks of remote files are fetched once into a local spool
        (``load.spool``) that these runs and the next ``read_many`` read, and hash again,
        instead of the storage."""
        self.prefetch(jobs)
        todo: dict[tuple[str, int], Located] = {}
        for j in jobs:
            for loc in self.plan_reads(j):
                todo.setdefault((loc.file, loc.chunk.begin), loc)
        locs = list(todo.values()) if self.verify_checksums else []
        self._drop_spool()
        self._spool = spool_remote(locs, self._reader, self.spool_dir) if locs else None
        files = sorted({loc.file for loc in locs})
        # Without a spool a remote file is read by ranged GETs: one chunk per task, as many
        # in flight as threads (no readahead to keep a long run busy).
        sequential = self._spool is not None or len(self.local_files(files)) == len(files)
        runs = file_runs(locs, lambda loc: loc, SEQUENTIAL_RUN if sequential else 0)
        try:
            if len(runs) <= 1:
                for run in runs:
                    self._verify_run(run)
            else:
                with ThreadPoolExecutor(min(IO_THREADS, len(runs))) as pool:
                    for f in [pool.submit(self._verify_run, run) for run in runs]:
                        f.result()
        except BaseException:
            self._drop_spool()  # no fill follows a failed check
            raise
        return sum(loc.chunk.nbytes for loc in locs)

    def _drop_spool(self) -> None:
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()

    def _verify_run(self, run: list[Located]) -> None:
        """Hash and check each chunk of ``run`` (adjacent in one file, in file order), reading
        it front to back in ``READ_STEP`` pieces through this thread's buffer."""
        file, hi = run[0].file, run[-1].byte_range[1]
        buf, at = memoryview(b""), run[0].byte_range[0]  # the buffer holds file bytes [at, at + len(buf))
        for loc in run:
            start, end = loc.byte_range
            h = Hasher()
            while start < end:
                if start >= at + len(buf):
                    at += len(buf)
                    buf = self._piece(min(READ_STEP, hi - at))
                    self.pread(file, at, buf)
                stop = min(end, at + len(buf))
                h.update(buf[start - at : stop - at])
                start = stop
            self.check_digest(loc, h.hexdigest())

    def plan_reads(self, job: ReadJob) -> list[Located]:
        """The chunks ``job`` reads from, after the checks ``load.fill`` makes of its target."""
        check_target(self, job)
        want = region_of(job)
        found = self.locate(job.name, want)
        covered = sum(p.numel for p in (intersection(loc.box, want) for loc in found) if p is not None)
        check_covered(self, job, covered)
        return found

    def read_into(self, job: ReadJob) -> None:
        """Fill ``job.target`` from every chunk that overlaps its region, each chunk read whole
        and checked against its checksum (``InvalidCheckpoint`` naming file, tensor and byte
        range on a mismatch)."""
        fill_target(self, job, verify=self.verify_checksums)

    def read_into_unverified(self, job: ReadJob) -> None:
        """Like ``read_into``, but reading only the bytes the target needs, unchecked: only for
        a caller that checks them against a checksum of verified bytes (reshard's second pass
        compares each chunk it writes with its verified first pass's digest)."""
        fill_target(self, job, verify=False)

    def _piece(self, n: int) -> memoryview:
        """This thread's piece buffer, ``n`` bytes of it (grown when needed: one row may be
        larger than ``VERIFY_PIECE``)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(max(n, 1))
        return memoryview(buf)[:n]

    def check_digest(self, loc: Located, got: str, name: str | None = None) -> None:
        """``InvalidCheckpoint`` naming file, tensor and byte range when ``got`` (the digest of
        the bytes read for chunk ``loc``) is not its checksum; nothing when checksums are off."""
        c = loc.chunk
        if self.verify_checksums and c.checksum is not None and got != c.checksum:
            start, end = loc.byte_range
            raise InvalidCheckpoint(
                f"{self.storage.url_of(loc.file)}: tensor {name or c.name!r} (bytes {start}-{end}) "
                "does not match its checksum",
                hint="the shard is corrupt; resume from an older checkpoint (`ckptctl latest`)",
            )

    # --- files ------------------------------------------------------------------------------

    def pread(self, file: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``offset..`` of ``file`` (from the spool when it holds them),
        unchecked: the caller hashes them."""
        if len(out):
            spool = self._spool
            if spool is None or not spool.read_into(file, offset, out):
                self._reader(file).read_into(offset, out)

    def local_files(self, files: Sequence[str]) -> set[str]:
        """Those of ``files`` read through a local descriptor (a second read would come from
        the page cache, and the kernel reads ahead of a sequential reader), not fetched over a
        network. Opens them, in parallel (a HEAD each on S3)."""
        with ThreadPoolExecutor(max(1, min(IO_THREADS, len(files)))) as pool:
            return {f for f, r in zip(files, pool.map(self._reader, files)) if r.local_fd() is not None}

    def _reader(self, file: str) -> Reader:
        with self._lock:
            r = self._readers.get(file)
            if r is None:
                r = self._readers[file] = self.storage.open_reader(file)
            return r

    def close(self) -> None:
        """Close every file this reader opened; it may be used again (files reopen on demand)."""
        self._drop_spool()
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
