"""``cp`` and ``restore``: one committed checkpoint, of any layout, copied by the one engine
(``ops.transfer.engine``): every byte checked on the way as its layout says, nothing at the
destination ever replaced, the commit record written last.

* ``copy_found`` (``cp``): the checkpoint ``layouts.classify`` found, into DST itself when DST
  is named like one of that layout's checkpoints, else under DST (so that DST works as a root);
  ``copy_checkpoint``: the same for a checkpoint given as a storage;
* ``restore_latest``: the newest committed checkpoint of a root that checks out (or a pinned
  step), of any layout whose checkpoints are directories, into a destination root; one that does
  not check out is skipped for the next newest. ``world_size`` re-shards a checkpoint ckptctl
  can re-shard (its ``CopySource.world_size``) on the way.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ckptctl.errors import (CheckpointError, CkptError, InvalidCheckpoint, NoValidCheckpoint, NotFound, RefusedForSafety,
                            StorageError, UsageError)
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import layout_named, newest_marked
from ckptctl.layouts.classify import Found, classify
from ckptctl.layouts.native_commit import remove, uncommit
from ckptctl.layouts.native_read import Committed, read_committed_raw
from ckptctl.ops.transfer.engine import CopyResult, copy_in_layout
from ckptctl.ops.transfer.files import at_destination
from ckptctl.ops.transfer.staging import new_staging_name
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS
from ckptctl.storage.base import ObjectInfo, Storage

if TYPE_CHECKING:
    from ckptctl.ops.transform.reshard import ReshardReport

log = logging.getLogger("ckptctl")

__all__ = ["CopyResult", "RestoreResult", "Skipped", "copy_checkpoint", "copy_found", "restore_latest"]


def copy_checkpoint(src: Storage, dst: Storage, progress: Progress | None = None, *,
                    threads: int = COPY_THREADS) -> CopyResult:
    """Copy the committed checkpoint at ``src`` (its layout told by ``layouts.classify``) to
    ``dst``, the copy's own directory (``ops.transfer.engine.copy_in_layout``)."""
    return copy_in_layout(layout_of(src), src, dst, into_root=False, progress=progress, threads=threads)


def layout_of(ckpt: Storage) -> Layout:
    """The layout of the checkpoint at ``ckpt``, bound to its root (``layouts.classify``);
    NotFound when nothing there is a checkpoint."""
    found = classify(ckpt.local_path() or ckpt.url)
    if found.what != "checkpoint":
        raise NotFound(f"{ckpt.url}: not a checkpoint ({found.reason or found.what})",
                       hint="give the path of one committed checkpoint")
    return found.in_layout


def copy_found(layout: Layout, src: Storage, dst: Storage, progress: Progress | None = None) -> CopyResult:
    """``cp``: the checkpoint ``src`` of ``layout`` into ``dst`` itself when ``dst`` is named
    like one of that layout's checkpoints, else under ``dst`` by its own name."""
    last = dst.url.rstrip("/").rsplit("/", 1)[-1]
    named = layout.step_of(ObjectInfo(last, 0, 0.0, "file" if layout.files_are_checkpoints else "dir")) is not None
    return copy_in_layout(layout, src, dst, into_root=not named, progress=progress)


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
    found: Found | None = None,
) -> RestoreResult:
    """Copy the newest committed checkpoint of ``src_root`` that checks out (or ``step``) into
    ``dst_root`` under its own name, checked on the fly; returns where it landed and what its
    stack's resume takes (``Layout.resume``: the checkpoint, or the root for Megatron).

    A candidate that does not check out is reported through ``on_skip`` and the next newest is
    tried; with ``step`` pinned, it raises instead. ``src_root`` may also name one checkpoint
    (``layouts.classify``). Raises NoValidCheckpoint when nothing checks out, UsageError for a
    ``world_size`` its layout cannot re-shard to.

    ``world_size`` different from the saved one: the checkpoint is copied (and checked) into a
    hidden staging directory of this run's own under ``dst_root`` (``ops.transfer.staging``),
    re-sharded from there into the step directory by ``ops.transform.reshard`` (which verifies
    its result), and the staging copy is removed, on success and on failure alike.
    So the source is read once, over the network, and the fallback past corruption works the same.

    ``found``: what ``layouts.classify`` found at ``src_root``, when the caller asked it already
    (it is not asked again: on object storage its listing is the catalog's too).
    """
    if world_size is not None:  # before a byte is copied: a bad one would fail only after the copy
        from ckptctl.ops.transform.reshard import check_world_size

        check_world_size(world_size)

    def restore_one(layout: Layout, src: Storage) -> CopyResult:
        source = layout.copy_source(src) if world_size is not None else None
        if source is not None and world_size != _saved_ranks(layout, source.world_size, src):
            return _reshard_restore(layout, src, dst_root, source.record, world_size, progress, threads)  # type: ignore[arg-type]
        return copy_in_layout(layout, src, dst_root, progress=progress, threads=threads)

    return restore_first(candidates(src_root, step, found), restore_one, src_root, dst_root, step, on_skip)


def restore_first(tries: Iterable[tuple[Layout, Storage, int]], restore_one: Callable[[Layout, Storage], CopyResult],
                  src_root: Storage, dst_root: Storage, step: int | None,
                  on_skip: Callable[[Skipped], None] | None) -> RestoreResult:
    """The first of ``tries`` (``candidates``: layout, checkpoint, step; newest first) that
    ``restore_one`` copies into ``dst_root``, and what its stack resumes from. One that does
    not check out is passed over for the next, told to ``on_skip`` (raised instead when
    ``step`` is pinned); when none is left, the error says why nothing was restored."""
    skipped: list[Skipped] = []
    for layout, src, cand_step in tries:
        try:
            copied = restore_one(layout, src)
        except (InvalidCheckpoint, NotFound) as e:
            if step is not None:
                raise
            skipped.append(Skipped(src.url, cand_step, str(e)))
            if on_skip is not None:
                on_skip(skipped[-1])
            continue
        dst = dst_root.sub(copied.dst.rstrip("/").rsplit("/", 1)[-1])
        return RestoreResult(layout.resume(dst.local_path() or dst.url, copied.step).path, copied.step, copied, skipped)
    raise _nothing_restored(src_root, step, skipped)


def _saved_ranks(layout: Layout, saved: int | None, src: Storage) -> int:
    if saved is None:
        raise UsageError(f"--world-size re-shards ckptctl checkpoints only; {src.url} is a {layout.name} checkpoint",
                         hint="restore without it, or `ckptctl convert --to ckptctl` first")
    return saved


def candidates(src_root: Storage, step: int | None, found: Found | None = None) -> Iterator[tuple[Layout, Storage, int]]:
    """The checkpoints ``restore`` tries, newest first, with their steps: ``src_root`` itself
    when it is one checkpoint (``layouts.classify``), else the committed (or corrupt-looking)
    checkpoint directories under it of every layout, lazily (a bucket of thousands of
    checkpoints costs one listing and a look per candidate tried). One-file checkpoints are
    ``cp``'s, not restore's; a symlinked step directory is never followed. ``found``: what
    ``layouts.classify`` found at ``src_root``, when the caller asked it already."""
    if found is None:
        found = classify(src_root.local_path() or src_root.url)
    if found.what == "checkpoint" and not found.in_layout.files_are_checkpoints:
        layout = found.in_layout
        own = layout.copy_source(src_root).step
        if step is not None and step != own:
            raise NoValidCheckpoint(f"{src_root.url} is the checkpoint of step {own}, not {step}",
                                    hint="give the checkpoint root as SRC to choose a step")
        yield layout, src_root, own
        return
    for entry in newest_marked(src_root, step=step, children=found.children):
        layout = entry.owner or layout_named(entry.layout, src_root)  # bound to the root by the catalog
        if entry.storage is not None and not layout.files_are_checkpoints:
            yield layout, entry.storage, entry.step


def _nothing_restored(src_root: Storage, step: int | None, skipped: list[Skipped]) -> CkptError:
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


# --- a re-sharding restore ------------------------------------------------------------------


def _reshard_restore(layout: Layout, src: Storage, dst_root: Storage, record: object, world_size: int,
                     progress: Progress | None, threads: int) -> CopyResult:
    """A ckptctl checkpoint restored re-sharded for ``world_size`` ranks: copied (and checked)
    into this run's own staging directory (``ops.transfer.staging``), re-sharded from there
    into its step directory; the staging copy is removed however the run ends, short of a kill."""
    assert isinstance(record, Committed)
    step = record.manifest.step
    dst = dst_root.sub(step_dir(step))
    if at_destination(dst, lambda: _resharded_present(dst, record, world_size)):
        return CopyResult(src.url, dst.url, step, "already present", files=world_size)
    staging = dst_root.sub(new_staging_name(step))
    try:
        copied = copy_in_layout(layout, src, staging, into_root=False, progress=progress, threads=threads)
        report = _reshard_staged(staging, dst, record, world_size, progress)
    finally:
        _remove_staging(staging)
    if report is None:
        return CopyResult(src.url, dst.url, step, "already present", files=world_size)
    return CopyResult(copied.src, dst.url, copied.step, "copied", files=report.files,
                      bytes_copied=copied.bytes_copied, files_reused=copied.files_reused,
                      seconds=copied.seconds + report.seconds)


def _reshard_staged(staging: Storage, dst: Storage, record: Committed, world_size: int,
                    progress: Progress | None) -> ReshardReport | None:
    """Re-shard the staging copy into ``dst``; None when ``dst`` turned out to hold this very
    checkpoint re-sharded already (a concurrent restore of the same step committed it)."""
    # Imported here: only a re-sharding restore needs the reshard machinery (and torch's).
    from ckptctl.ops.transform.reshard import reshard

    # Leftovers of an interrupted restore (no marker) are written beside; a dst committed since
    # _resharded_present looked (a concurrent restore of the same step) is judged again, never
    # removed: deciding "overwrite" from that earlier look removed another restore's result.
    # The source was checked byte for byte into the staging copy, which no other run touches: a
    # problem found from here on is this root's, never the source's, so it is judged again and
    # never makes restore skip to an older step.
    try:
        return reshard(staging, dst, world_size, overwrite="uncommitted", progress=progress)
    except (RefusedForSafety, InvalidCheckpoint, NotFound) as e:
        if at_destination(dst, lambda: _resharded_present(dst, record, world_size)):
            return None
        if isinstance(e, RefusedForSafety):
            raise
        raise StorageError(f"{staging.url}: the staging copy of step {record.manifest.step}, checked as it was made, "
                           f"is no longer whole: {e}",
                           hint="did something delete it (a prune with a --partial-after shorter than the restore)? "
                                "run the restore again") from None


def _remove_staging(staging: Storage) -> None:
    """This run's own staging copy, never read by anything else: removed (marker first) on
    success and on every failure. A removal that fails itself (the outage that failed the
    restore) leaves it to prune, which deletes it once idle for ``--partial-after``."""
    try:
        remove(staging)
    except (StorageError, NotFound) as e:
        log.warning("restore: the staging copy %s was not removed (%s); `ckptctl prune` deletes it once idle",
                    staging.url, e)


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
