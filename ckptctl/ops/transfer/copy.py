"""Copying committed checkpoints between storages: ``cp`` and ``restore``.

(Other tools' checkpoints are copied by ``ops.transfer.stack_copy``, with the same result types.)

A copy reads every source byte once and checks it on the way (file XXH3 and each tensor
chunk's checksum, the same streaming check as ``verify``), writes the shards through the
destination's atomic writers, then the manifest, then the marker, last and only when every
byte checked out. So a destination without a marker is never mistaken for a checkpoint, an
interrupted copy run again restarts cleanly (shards whose bytes already verify in place are
kept), and a corrupt source commits nothing.

Memory: ``threads`` files at once, each holding one read piece (16 MiB) plus what its writer
buffers (on S3, up to ``max_inflight_parts + 1`` parts: 144 MiB by default); never a whole file.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Literal, TypeVar

from ckptctl.errors import (
    CheckpointError,
    CkptError,
    InvalidCheckpoint,
    NoValidCheckpoint,
    NotFound,
    RefusedForSafety,
    StorageError,
)
from ckptctl.format.layout import MARKER, parse_step_dir, step_dir
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import ShardHeader
from ckptctl.layouts.catalog import NATIVE, newest_marked
from ckptctl.layouts.native import (
    Committed,
    check_target_name,
    commit_copy,
    read_committed_raw,
    remove,
    remove_leftovers,
    uncommit,
)
from ckptctl.ops.distributed import Job, agree, attempt, current, gathered, mine, on_root, unanimous
from ckptctl.progress import expect_bytes
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS
from ckptctl.storage.base import Storage


CopyStatus = Literal["copied", "already present"]
T = TypeVar("T")


@dataclass
class CopyResult:
    src: str
    dst: str
    step: int
    status: CopyStatus
    files: int = 0
    bytes_copied: int = 0
    files_reused: int = 0  # already in place with verified bytes (an interrupted copy re-run)
    seconds: float = 0.0
    layout: str = "ckptctl"  # whose checkpoint (another tool's: ``ops.transfer.stack_copy``)
    note: str | None = None  # how another tool's checkpoint was checked, and its pointer
    # Under torchrun: what each rank (cp) or node (restore) copied; empty otherwise.
    ranks: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.ranks:  # a plain run's document is unchanged
            del d["ranks"]
        return d


def describe_problems(problems: list[Problem], where: str) -> str:
    # The most precise problem first: a tensor and byte range say more than "file checksum".
    first = min(problems, key=lambda p: (p.tensor is None, p.byte_range is None))
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {first}{more}"


def copy_checkpoint(src: Storage, dst: Storage, progress: Progress | None = None, *, threads: int = COPY_THREADS) -> CopyResult:
    """Copy the committed checkpoint at ``src`` to ``dst`` (a checkpoint directory).

    Raises NotFound (src not committed), InvalidCheckpoint (src corrupt: nothing is committed
    at dst, and the shards this call wrote are removed), RefusedForSafety (dst already holds a
    different committed checkpoint, or is the directory of another step) or StorageError.

    Under a torchrun verb (``ops.distributed.current``; ``dst`` shared by the ranks) each rank
    checks and copies its share of the files, balanced by bytes; rank 0 commits once every
    rank's files are durable and checked, and every rank returns the same result or raises the
    same error (``ops.distributed.agree``).
    """
    t0 = time.perf_counter()
    job = current()
    source = on_root(job, lambda: read_committed_raw(src))  # one read of the manifest, sent to every rank
    manifest = source.manifest
    check_target_name(dst, manifest.step)
    result = CopyResult(src.url, dst.url, manifest.step, "copied", files=len(manifest.files))
    with _at_destination(dst):
        present = _already_present(source, dst, job)
    if present:
        result.status = "already present"
        result.seconds = time.perf_counter() - t0
        return result
    failure = None
    if job is None or job.rank == 0:  # a killed earlier run's uploads
        _, failure = attempt(lambda: at_destination(dst, lambda: before_copy(dst, [f.name for f in manifest.files])))
    agree(job, failure)  # nobody writes before they are gone
    files = [manifest.files[i] for i in mine(job, [f.size for f in manifest.files])]
    done, failure = attempt(lambda: copy_files(src, dst, source, files, progress, threads=threads))
    copied = gathered(job, done, failure)
    problems = [p for f in manifest.files for d in copied if d is not None for p in d.problems.get(f.name, [])]
    if problems:
        # The source is corrupt: each rank takes back what it wrote so no half copy is left behind.
        _, failure = attempt(lambda: at_destination(dst, lambda: done.take_back(dst) if done is not None else None))
        agree(job, failure)  # every rank's files are gone before the directory is removed
        if job is None or job.rank == 0:
            at_destination(dst, lambda: dst.remove_dir(""))  # only if now empty; a no-op on S3
        raise InvalidCheckpoint(describe_problems(problems, src.url), hint=(problems[0].hint or "copy an older checkpoint")
                                if any(d.before_copy for d in copied if d is not None)
                                else "the source was modified after it was written; copy an older checkpoint")

    # The marker last: the copy is a checkpoint only once every byte above checked out, on every rank.
    failure = None
    if job is None or job.rank == 0:
        _, failure = attempt(lambda: at_destination(dst, lambda: (commit_copy(dst, source),
                                                                   remove_leftovers(dst, [f.name for f in manifest.files]))))
    agree(job, failure)
    result.bytes_copied = sum(d.bytes_copied for d in copied if d is not None)
    result.files_reused = sum(d.reused for d in copied if d is not None)
    if job is not None:
        result.ranks = [{"rank": r, "node": job.nodes[r], "files": d.files if d else 0, "bytes": d.bytes_copied if d else 0}
                        for r, d in enumerate(copied)]
    result.seconds = time.perf_counter() - t0
    return result


@dataclass
class Copied:
    """What ``copy_files`` did with its files: the problems found, by file (nothing committed
    for those), the files it wrote and the ones already in place."""

    problems: dict[str, list[Problem]] = field(default_factory=dict)
    before_copy: bool = False  # the problems were found by the header checks, before any copying
    written: list[str] = field(default_factory=list)
    files: int = 0
    reused: int = 0
    bytes_copied: int = 0

    def take_back(self, dst: Storage) -> None:
        """Delete the files this copy wrote (after a corrupt source was found)."""
        for name in self.written:
            dst.delete(name)


def copy_files(src: Storage, dst: Storage, source: Committed, files: list[FileEntry], progress: Progress | None = None,
               *, threads: int = COPY_THREADS) -> Copied:
    """Copy ``files`` of the committed checkpoint ``source`` (at ``src``) to ``dst``, each byte
    checked on the way (header against the manifest first, then every chunk and the file
    checksum as it streams), each file committed by its writer once it checked out. A file
    whose bytes already verify at ``dst`` is kept. Writes no manifest or marker: the caller
    commits once every file of every rank is in place. Raises StorageError."""
    manifest = source.manifest
    out = Copied(files=len(files))

    def quick_check(f: FileEntry) -> tuple[ShardHeader | None, list[Problem]]:
        found: list[Problem] = []
        return check_file(src, f, manifest, found), found

    headers: dict[str, ShardHeader] = {}
    # In parallel: on S3 each file costs a HEAD and a ranged GET, and a job has many ranks.
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptctl-check") as pool:
        for f, (h, found) in zip(files, pool.map(quick_check, files)):
            if found:
                out.problems[f.name] = found
            if h is not None:
                headers[f.name] = h
    if out.problems:
        out.before_copy = True
        return out

    expect_bytes(progress, sum(f.size for f in files))  # a bar's total, %, ETA
    lock = threading.Lock()
    stop = threading.Event()  # one corrupt or failed file ends the others early

    def copy_one(f: FileEntry) -> tuple[list[Problem], bool]:
        with _at_destination(dst):
            reusable = _reusable(dst, f, headers[f.name])
            writer = None if reusable else dst.open_writer(f.name)
        if writer is None:
            if progress:
                progress(f.size)
            return [], True
        try:
            found, _ = stream_file(src, f, headers[f.name], progress, sink=writer.write, stop=stop)
        except BaseException:
            stop.set()
            writer.abort()
            raise
        if found or stop.is_set():
            stop.set()
            writer.abort()
            return found, False
        with _at_destination(dst):
            writer.commit()
        with lock:
            out.written.append(f.name)
        return [], False

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptctl-copy") as pool:
        futures: list[Future[tuple[list[Problem], bool]]] = [pool.submit(copy_one, f) for f in files]
        try:
            wait(futures)
        except BaseException:
            stop.set()  # Ctrl-C: workers abort their writers at the next piece instead of finishing
            for future in futures:
                future.cancel()
            raise
    for future in futures:
        future.result()  # a storage error or interrupt in any worker surfaces here
    for f, future in zip(files, futures):
        found, reused = future.result()
        if found:
            out.problems[f.name] = found
        out.reused += reused
    out.bytes_copied = sum(f.size for f in files if f.name in out.written)
    return out


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


def _already_present(source: Committed, dst: Storage, job: Job | None = None) -> bool:
    """True when ``dst`` already commits the same manifest and its bytes verify (checksums).

    A committed destination holding anything else is refused, never overwritten: it may be
    the only copy of another checkpoint. The same checkpoint damaged in place is uncommitted
    (marker first) so that the caller copies it again. Under a torchrun verb every rank calls
    this (the verification is split over them) and gets the same answer."""
    same, failure = attempt(lambda: _committed_same(source, dst))
    agree(job, failure)
    if not unanimous(job, same, dst.url_of(MARKER)):
        return False
    # Every byte, not just sizes and headers: a flipped byte in a copy that is then trusted
    # as "already there" would be handed to training.
    if verify_checkpoint(dst, "checksums").ok:
        return True
    if job is None or job.rank == 0:
        uncommit(dst)
    agree(job, None)  # nobody copies before the marker is gone
    return False


def _committed_same(source: Committed, dst: Storage) -> bool:
    """Whether ``dst`` is committed (False: no marker); RefusedForSafety when it commits
    another checkpoint, or something that is not one."""
    if dst.stat(MARKER) is None:
        return False
    try:
        existing = read_committed_raw(dst)
    except CheckpointError as e:
        raise RefusedForSafety(
            f"{dst.url} already has a {MARKER} marker but is not a valid checkpoint ({e})",
            hint=f"inspect it with `ckptctl verify {dst.url}`; remove it (marker first) to replace it",
        ) from None
    if existing.manifest_raw != source.manifest_raw:
        raise RefusedForSafety(
            f"{dst.url} already holds a different committed checkpoint (step {existing.manifest.step})",
            hint="choose another destination, or delete that checkpoint first",
        )
    return True


def _reusable(dst: Storage, f: FileEntry, h: ShardHeader) -> bool:
    """A shard an interrupted copy already wrote: kept when its bytes verify in place.

    Only on a filesystem, where reading back is far cheaper than fetching again."""
    if dst.local_path() is None:
        return False
    info = dst.stat(f.name)
    if info is None or info.kind != "file" or info.size != f.size:
        return False
    found, _ = stream_file(dst, f, h)
    return not found


# --- restore -----------------------------------------------------------------------------


@dataclass
class Skipped:
    url: str
    step: int
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RestoreResult:
    path: str  # what a job script resumes from: a filesystem path, or the URL on S3
    step: int
    copy: CopyResult
    skipped: list[Skipped] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"path": self.path, "step": self.step, "copy": self.copy.to_dict(), "skipped": [s.to_dict() for s in self.skipped]}


def restore_latest(
    src_root: Storage,
    dst_root: Storage,
    step: int | None = None,
    progress: Progress | None = None,
    *,
    world_size: int | None = None,
    on_skip: Callable[[Skipped], None] | None = None,
    threads: int = COPY_THREADS,
) -> RestoreResult:
    """Copy the newest committed checkpoint of ``src_root`` that verifies (or ``step``) to
    ``dst_root/step-XXXXXXXXXX``, checked on the fly; returns where it landed.

    A corrupt candidate is reported through ``on_skip`` and the next newest is tried; with
    ``step`` pinned, corruption raises InvalidCheckpoint instead. ``src_root`` may also name
    one checkpoint directly (it has a marker). Raises NoValidCheckpoint when nothing verifies.

    ``world_size`` different from the saved one: the checkpoint is copied (and checked) into a
    hidden staging directory under ``dst_root``, re-sharded from there into the step directory
    by ``ops.transform.reshard`` (which verifies its result), and the staging copy is removed. So the
    source is read once, over the network, and the fallback past corruption works the same.
    """
    if world_size is not None:  # before a byte is copied: a bad one would fail only after the copy
        from ckptctl.ops.transform.reshard import check_world_size

        check_world_size(world_size)
    skipped: list[Skipped] = []
    for cand_step, src in candidates(src_root, step):
        dst = dst_root.sub(step_dir(cand_step))
        reshard_to = None
        try:
            source = read_committed_raw(src)
            if world_size is not None and world_size != source.manifest.world_size:
                reshard_to = world_size
                with _at_destination(dst):
                    present = _resharded_present(dst, source, world_size)
                if present:
                    done = CopyResult(src.url, dst.url, cand_step, "already present", files=world_size)
                    return RestoreResult(dst.local_path() or dst.url, cand_step, done, skipped)
                staging = dst_root.sub(STAGING_PREFIX + step_dir(cand_step))
                copied = copy_checkpoint(src, staging, progress, threads=threads)
            else:
                copied = copy_checkpoint(src, dst, progress, threads=threads)
        except (InvalidCheckpoint, NotFound) as e:
            if step is not None:
                raise
            skip_candidate(skipped, Skipped(src.url, cand_step, str(e)), on_skip)
            continue
        if reshard_to is not None:
            copied = _reshard_staged(staging, dst, reshard_to, copied, progress)
        return RestoreResult(dst.local_path() or dst.url, cand_step, copied, skipped)
    raise nothing_restored(src_root, step, skipped)


def skip_candidate(skipped: list[Skipped], skip: Skipped, on_skip: Callable[[Skipped], None] | None) -> None:
    """A corrupt candidate passed over for the next newest: recorded, and told to ``on_skip``."""
    skipped.append(skip)
    if on_skip is not None:
        on_skip(skip)


def nothing_restored(src_root: Storage, step: int | None, skipped: list[Skipped]) -> CkptError:
    """The error of a restore that found no candidate to copy (``skipped``: those that did not
    verify): the pinned step is missing, SRC holds no checkpoint, or none verifies."""
    if step is not None:
        return NoValidCheckpoint(f"{src_root.url}: no committed checkpoint at step {step}",
                                 hint=f"list what is there with `ckptctl ls {src_root.url}`")
    if not skipped:  # say what SRC holds instead, from the listing `ls` shows
        from ckptctl.ops.listing import nothing_to_restore

        return nothing_to_restore(src_root)
    return NoValidCheckpoint(f"{src_root.url}: none of {len(skipped)} committed checkpoints verifies",
                             hint="run `ckptctl verify SRC --all` to see what is wrong with each")


# Staging copies for a re-sharding restore: hidden, and not a step directory, so nothing that
# lists checkpoints (ls, latest, prune, load_latest) ever sees one.
STAGING_PREFIX = ".restore-staging-"


def _resharded_present(dst: Storage, source: Committed, world_size: int) -> bool:
    """A committed ``dst`` that is this checkpoint re-sharded for ``world_size``: same step,
    tensors and state, ``world_size`` ranks, and its bytes verify. Anything else committed there
    is refused; the same one damaged in place is uncommitted (marker first), to be redone."""
    if dst.stat(MARKER) is None:
        return False
    try:
        existing = read_committed_raw(dst).manifest
    except CheckpointError as e:
        raise RefusedForSafety(
            f"{dst.url} already has a {MARKER} marker but is not a valid checkpoint ({e})",
            hint=f"inspect it with `ckptctl verify {dst.url}`; remove it (marker first) to replace it",
        ) from None
    m = source.manifest

    def layout_free(tensors: dict) -> dict:  # chunk counts change with the world size
        return {n: (t.dtype, t.shape, t.group) for n, t in tensors.items()}

    same = (existing.step, existing.world_size, layout_free(existing.tensors), existing.state) == (
        m.step, world_size, layout_free(m.tensors), m.state)
    if not same:
        raise RefusedForSafety(
            f"{dst.url} already holds a different committed checkpoint (step {existing.step}, "
            f"{existing.world_size} ranks)",
            hint="choose another destination, or delete that checkpoint first",
        )
    if verify_checkpoint(dst, "checksums").ok:
        return True
    uncommit(dst)
    return False


def _reshard_staged(staging: Storage, dst: Storage, world_size: int, copied: CopyResult, progress: Progress | None) -> CopyResult:
    # Imported here: only a re-sharding restore needs the reshard machinery (and torch's).
    from ckptctl.ops.transform.reshard import reshard

    # Leftovers of an interrupted restore (no marker) may be replaced; a committed dst was
    # handled by _resharded_present and never reaches this point.
    report = reshard(staging, dst, world_size, overwrite=dst.stat(MARKER) is None, progress=progress)
    remove(staging)
    return CopyResult(copied.src, dst.url, copied.step, "copied", files=report.files,
                      bytes_copied=copied.bytes_copied, files_reused=copied.files_reused,
                      seconds=copied.seconds + report.seconds)


def candidates(src_root: Storage, step: int | None) -> Iterator[tuple[int, Storage]]:
    """Checkpoints with a marker, newest first. Lazy: a bucket of thousands of checkpoints
    costs one listing and a HEAD per candidate tried, not a HEAD per checkpoint. SRC with a
    marker of its own is one checkpoint, not a root."""
    if src_root.stat(MARKER) is not None:
        own = read_committed_raw(src_root).manifest.step
        if step is not None and step != own:
            raise NoValidCheckpoint(
                f"{src_root.url} is the checkpoint of step {own}, not {step}",
                hint="give the checkpoint root as SRC to choose a step",
            )
        yield own, src_root
        return
    for entry in newest_marked(src_root, step=step, layouts=NATIVE):  # a symlinked step dir is never followed
        if entry.storage is not None:
            yield entry.step, entry.storage


def checkpoint_dir_for(dst: Storage, step: int) -> Storage:
    """Where ``cp`` puts a checkpoint: DST itself when it is named like a step directory,
    otherwise a step directory under DST (so that DST works as a root)."""
    last = dst.url.rstrip("/").rsplit("/", 1)[-1]
    return dst if parse_step_dir(last) is not None else dst.sub(step_dir(step))
