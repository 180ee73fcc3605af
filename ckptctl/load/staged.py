"""An all-or-nothing load in one pass: every chunk read once into host memory, checked there,
and only then copied into the live tensors.

``load.into_state`` hands this module a load's read jobs: *live* ones, whose targets are the
caller's tensors (parameters, optimizer state, DTensor shards), and *fresh* ones, tensors the
load made itself, which nobody sees before the load applies its results. The host memory for
the live ones is lent by the caller (``HostLender``: the ``Checkpointer`` lends its staging
buffer, the size of this rank's state, page-locked for GPU state; the bytes of a GPU target
pass through host memory anyway).

1. Plan (``StagedLoad``): a live job whose region is exactly one saved chunk gets that chunk's
   bytes at a place in host memory; these places are laid out in file order, so a run of
   adjacent chunks is one piece, never one read per small tensor. On S3 (a file without a
   local descriptor) a piece is at most ``VERIFY_PIECE``, one ranged GET. A local file's
   pieces are runs of up to ``SEQUENTIAL_RUN``, each read front to back in ``READ_STEP`` calls,
   so the kernel reads ahead of every reader (``settings``, ``docs/decisions.md``, "Loads read
   local files as long sequential runs"). Any other live job (a region made of parts of
   chunks: re-sharding) gets a contiguous host copy of its target, filled by
   ``CheckpointReader.read_into`` (each chunk read and hashed whole, the needed part kept, the
   rest only hashed). Fresh targets are filled in place the same way.
2. Fetch: all of that on ``IO_THREADS`` threads. A chunk is hashed as soon as its last byte is
   in (while a small one is still in the CPU's cache; a chunk larger than a piece once its last
   piece has landed) and checked against its checksum. Any failure raises before a live tensor
   is touched.
3. Apply: each host copy into its target. Host targets: memcpys (``state.buffers.copy_host``).
   CUDA targets: asynchronous
   copies out of the page-locked memory, queued on the caller's current stream of the target's
   device (so they are ordered after every kernel the caller queued before the load and before
   every kernel it queues after), split where the memory's registrations meet (one copy never
   spans two pinned ranges: ``state.pinned``), and waited for before ``apply`` returns, since
   the lender hands the same memory to the next save.

Each byte is read from storage once: the chunks of a whole-tensor load tile the data section,
and a re-sharding load reads whole only the chunks its region overlaps (at most one per edge
of the region beyond what it keeps). ``docs/decisions.md``, "All-or-nothing loads in one
pass", has the figures and what a load does when no memory is lent.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from ckptctl.format.checksum import digest
from ckptctl.load.reader import CheckpointReader
from ckptctl.load.shard_index import Located, ReadJob, file_runs, region_of
from ckptctl.settings import IO_THREADS, READ_STEP, SEQUENTIAL_RUN, STAGING_ALIGN, VERIFY_PIECE
from ckptctl.state.buffers import copy_host, tensor_bytes
from ckptctl.state.pinned import HostRegion, host_wait_event, split_at

# A chunk's bytes sit at the same offset modulo this in host memory as in its shard's data
# section, where the format keeps every tensor aligned to its element size (tensors in
# decreasing element size): every host copy is a valid view of its dtype, and a whole shard's
# chunks take exactly its data section's size, as its save's staging buffer does.
_ALIGN = 64


class HostLender(Protocol):
    """Lends a load host memory of at least ``nbytes``, page-locked for copies to CUDA device
    ``pin_device`` when that is not None. ``map_new``: whether to map that memory when none
    is held yet (the load's files are remote, so reading twice would fetch twice or spool);
    None when it has none to lend (the load then reads twice instead: ``load.into_state``).
    The memory stays the load's until it returns."""

    def __call__(self, nbytes: int, pin_device: int | None, map_new: bool) -> HostRegion | None: ...


@dataclass(eq=False)
class _Placed:
    """A live job whose region is one whole chunk: the chunk's bytes go to host offset ``at``."""

    job: ReadJob
    loc: Located
    at: int = 0
    left: int = 1  # pieces of the chunk not read yet; the thread that reads the last one hashes it


@dataclass(eq=False)
class _Piece:
    """One read: bytes ``[lo, hi)`` of ``file`` into host bytes ``[at, at + hi - lo)``, in calls
    of ``step`` bytes; ``chunks`` are the placed chunks it holds all or part of, in file order."""

    file: str
    lo: int
    hi: int
    at: int
    step: int
    chunks: list[_Placed] = field(default_factory=list)


class StagedLoad:
    """One load's plan (made at construction, reading only shard headers), then ``fetch`` into
    lent memory and ``apply``. ``nbytes``: the host memory ``fetch`` needs; ``cuda_device``:
    the GPU of the first CUDA target (the memory is best page-locked under it), or None;
    ``remote``: whether a file to read has no local descriptor (S3, a tier's remote file)."""

    def __init__(self, reader: CheckpointReader, live: Sequence[ReadJob], fresh: Sequence[ReadJob]) -> None:
        self.reader = reader
        self.fresh = list(fresh)
        reader.prefetch([*live, *fresh])  # the headers the plan needs, opened in parallel
        placed: list[_Placed] = []
        others: list[ReadJob] = []
        seen: set[tuple[str, int]] = set()
        files: set[str] = set()
        for job in live:
            locs = reader.plan_reads(job)  # a target that does not fit raises here, before any read
            files.update(loc.file for loc in locs)
            if job.target.numel() == 0:
                continue
            if _is_whole(job, locs) and (locs[0].file, locs[0].byte_range[0]) not in seen:
                seen.add((locs[0].file, locs[0].byte_range[0]))
                placed.append(_Placed(job, locs[0]))
            else:
                others.append(job)
        for job in self.fresh:
            files.update(loc.file for loc in reader.plan_reads(job))
        placed.sort(key=lambda p: (p.loc.file, p.loc.byte_range[0]))
        local = reader.local_files(sorted(files))
        self.remote = local != files
        at = 0
        for i, p in enumerate(placed):
            before = placed[i - 1].loc if i else None
            if before is None or before.file != p.loc.file or before.byte_range[1] != p.loc.byte_range[0]:
                at += (p.loc.chunk.begin - at) % _ALIGN  # a new run: at == chunk.begin modulo _ALIGN
            p.at = at
            at += p.loc.chunk.nbytes
        self._placed = placed
        self._pieces = _pieces(placed, local)
        self._others: list[tuple[ReadJob, int]] = []
        for job in others:
            at = -(-at // STAGING_ALIGN) * STAGING_ALIGN
            self._others.append((job, at))
            at += job.target.numel() * job.target.element_size()
        self.nbytes = at
        cuda = [p.job.target.device for p in placed] + [j.target.device for j in others]
        self.cuda_device = next((_index(d) for d in cuda if d.type == "cuda"), None)
        self._region: HostRegion | None = None
        self._lock = threading.Lock()

    # --- fetch: read and check everything, change nothing ---------------------------------

    def fetch(self, region: HostRegion | None) -> None:
        """Read every chunk the load needs once, the live jobs' into ``region`` (at least
        ``nbytes``; None only when ``nbytes`` is 0), and check each against its checksum.
        Raises ``InvalidCheckpoint`` (or a storage error) before any live target changes."""
        if self.nbytes and (region is None or region.nbytes < self.nbytes):
            raise ValueError(f"StagedLoad.fetch: {region.nbytes if region else 0} bytes lent, {self.nbytes} needed")
        self._region = region
        mem = tensor_bytes(region.tensor) if region is not None else memoryview(b"")
        tasks: list[Callable[[], None]] = [lambda p=p: self._read_piece(p, mem) for p in self._pieces]
        tasks += [lambda j=job, at=at: self.reader.read_into(ReadJob(j.name, self._host(at, j.target), j.offsets))
                  for job, at in self._others]
        tasks += [lambda j=job: self.reader.read_into(j) for job in self.fresh]
        _run_all(tasks)

    def _read_piece(self, piece: _Piece, mem: memoryview) -> None:
        chunks = iter(piece.chunks)
        p = next(chunks, None)
        for pos in range(piece.lo, piece.hi, piece.step):
            end = min(pos + piece.step, piece.hi)
            self.reader.pread(piece.file, pos, mem[piece.at + pos - piece.lo : piece.at + end - piece.lo])
            while p is not None and min(p.loc.byte_range[1], piece.hi) <= end:  # its bytes of this piece are in
                self._landed(p, mem)
                p = next(chunks, None)

    def _landed(self, p: _Placed, mem: memoryview) -> None:
        """One piece holding part of ``p`` is in: the last one hashes and checks it."""
        with self._lock:
            p.left -= 1
            last = p.left == 0
        if last and self.reader.verify_checksums and p.loc.chunk.checksum is not None:
            got = digest(mem[p.at : p.at + p.loc.chunk.nbytes])
            self.reader.check_digest(p.loc, got, p.job.name)

    def _host(self, at: int, like: torch.Tensor) -> torch.Tensor:
        """The host copy of ``like`` at byte ``at`` of the lent memory."""
        assert self._region is not None
        n = like.numel() * like.element_size()
        return self._region.tensor[at : at + n].view(like.dtype).view(like.shape)

    # --- apply: every chunk checked; now the live tensors change ---------------------------

    def apply(self) -> None:
        """Copy every live job's checked bytes into its target (``fetch`` first)."""
        pairs = [(p.job.target, self._host(p.at, p.job.target)) for p in self._placed]
        pairs += [(job.target, self._host(at, job.target)) for job, at in self._others]
        uploads = [(t, h) for t, h in pairs if t.device.type == "cuda"]
        rest = copy_host([(t, h) for t, h in pairs if t.device.type != "cuda"])
        with torch.no_grad():
            for target, host in rest:
                target.copy_(host)  # strided host targets, other accelerators
            if uploads:
                assert self._region is not None
                _upload(uploads, self._region)


def _is_whole(job: ReadJob, locs: list[Located]) -> bool:
    """Whether ``job``'s region is exactly one saved chunk, aligned for its dtype in the shard."""
    if len(locs) != 1:
        return False
    loc, t = locs[0], job.target
    return (loc.box == region_of(job) and loc.chunk.nbytes == t.numel() * t.element_size()
            and loc.chunk.begin % t.element_size() == 0)


def _pieces(placed: list[_Placed], local: set[str]) -> list[_Piece]:
    """The reads that fetch ``placed`` (in file order, at their host offsets, which are
    contiguous wherever the chunks are adjacent in their file): adjacent chunks of one file
    share a piece of up to ``SEQUENTIAL_RUN`` bytes read in ``READ_STEP`` calls (a local file),
    or of up to ``VERIFY_PIECE`` read in one call (a ranged GET); a chunk larger than that is
    read in pieces of its own."""
    out: list[_Piece] = []
    for is_local, cap, step in ((True, SEQUENTIAL_RUN, READ_STEP), (False, VERIFY_PIECE, VERIFY_PIECE)):
        for run in file_runs([p for p in placed if (p.loc.file in local) == is_local], lambda p: p.loc, cap):
            file, lo, hi = run[0].loc.file, run[0].loc.byte_range[0], run[-1].loc.byte_range[1]
            if hi - lo <= cap:
                out.append(_Piece(file, lo, hi, run[0].at, step, run))
                continue
            (p,) = run  # a chunk larger than a piece
            p.left = -(-(hi - lo) // cap)
            out += [_Piece(file, a, min(a + cap, hi), p.at + a - lo, step, [p]) for a in range(lo, hi, cap)]
    return out


def _run_all(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` on up to ``IO_THREADS`` threads; on the first failure the ones not started
    are dropped, the running ones finish (they write into memory the caller owns), and the
    first error in task order is raised."""
    if len(tasks) <= 1:
        for t in tasks:
            t()
        return
    with ThreadPoolExecutor(min(IO_THREADS, len(tasks)), thread_name_prefix="ckptctl-load") as pool:
        futures: list[Future[None]] = [pool.submit(t) for t in tasks]
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            for f in futures:
                f.cancel()
        wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _upload(pairs: list[tuple[torch.Tensor, torch.Tensor]], region: HostRegion) -> None:
    """Queue each host copy's transfer into its CUDA target on the caller's current stream of the
    target's device, then wait for all of them. Each transfer is split where the region's
    page-locked registrations meet; a non-contiguous target is filled through a dense temporary
    on that stream (as ``copy_`` itself would), then scattered with one device copy."""
    base, bounds = region.tensor.data_ptr(), region.boundaries
    streams: dict[int, torch.cuda.Stream] = {}
    for target, host in pairs:
        index = _index(target.device)
        with torch.cuda.device(index):  # the temporary and the copies belong to the target's device
            dense = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype, device=target.device)
            src, dst = host.reshape(-1).view(torch.uint8), dense.reshape(-1).view(torch.uint8)
            at = host.data_ptr() - base
            for a, b in split_at(at, at + src.numel(), bounds):
                dst[a - at : b - at].copy_(src[a - at : b - at], non_blocking=True)
            if dense is not target:
                target.copy_(dense)
            streams[index] = torch.cuda.current_stream(index)
    done = []
    for stream in streams.values():
        event = host_wait_event()  # this thread sleeps in synchronize(), it does not spin
        event.record(stream)
        done.append(event)
    for event in done:
        event.synchronize()
