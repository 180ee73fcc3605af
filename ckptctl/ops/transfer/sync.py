"""``sync``: mirror every committed checkpoint of one root into another (local <-> S3).

The "save to fast local NVMe, mirror to object storage in the background" workflow, as one
command a cron job runs. In step order (oldest first, so a stack's pointer at DST ends on SRC's
newest), each committed checkpoint of SRC, of every layout, is copied by the one copy engine
(``ops.transfer.engine``) as ``cp`` copies it: every byte checked on the way as its layout says
(ckptctl's manifest, a seal; an unsealed checkpoint of another tool is test-loaded at DST), the
commit record last, a stack's pointer after it and never moved backwards. One that DST already
commits is checked, not copied again: the same record and every byte matching it, or for a
ckptctl checkpoint its entry in DST's verification record (``checksums`` level, by
fingerprint, so an unchanged copy is not downloaded again on every run; a copy this command
made is recorded as it is written, having been checked on the way). A damaged copy of the same
checkpoint is completed again (its commit record first); anything else under the same name is
left as is and reported.

Cost: an unsealed checkpoint of another tool has no checksums to compare, so one already
present is read at both ends on every run. Seal SRC's checkpoints first (``ckptctl seal ROOT``)
and later runs check DST against the seal instead.

Resumable: a sync killed at any point leaves DST's copy in progress without its commit record
(never mistaken for a checkpoint); the next run completes it, keeping the files that already
hold their proven bytes, and breaks the lock of the dead run (``ops.lock``).

``delete``: committed checkpoints of DST whose name SRC no longer has are removed as ``rm``
removes them (the file their layout's commit rule reads first), except what ``rm`` refuses
without ``--force``: DST's newest checkpoint of each layout that verifies, and whatever a
pointer of DST protects (DeepSpeed's ``latest``, Megatron's tracker, a best checkpoint). A source that holds no committed checkpoint
at all is refused (``RefusedForSafety``, before anything is copied or deleted) unless
``allow_empty_source``: that is what an unmounted volume looks like. Partial or corrupt entries
of DST are left alone (a save may be writing there; evidence). Everything runs under DST's lock,
the one ``prune`` and ``rm`` take. A checkpoint that does not check out is reported and the
others are copied; the result says which failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptctl.errors import CheckpointError, CkptError, InvalidCheckpoint, NotFound, OperationalError, RefusedForSafety
from ckptctl.layouts.base import Checkpoint, Layout
from ckptctl.layouts.catalog import layout_named, list_checkpoints
from ckptctl.layouts.checked import Checked
from ckptctl.layouts.protection import protected
from ckptctl.layouts.removal import entry_snapshot, remove_entry
from ckptctl.progress import counting_only, expect_bytes
from ckptctl.ops.lock import DEFAULT_STALE_AFTER_S, RootLock
from ckptctl.ops.targets import open_root
from ckptctl.ops.transfer import uploads
from ckptctl.ops.transfer.engine import copy_in_layout
from ckptctl.ops.transfer.uploads import UPLOAD_IDLE_S
from ckptctl.ops.verify.cache import VerifyCache, fingerprint, verify_cached
from ckptctl.progress import Progress
from ckptctl.storage import open_storage
from ckptctl.storage.base import Storage

__all__ = ["SyncItem", "SyncResult", "sync", "sync_roots"]

SyncAction = Literal["copied", "present", "deleted", "kept", "skipped", "failed", "would copy", "would delete"]
CHECK_LEVEL = "checksums"


@dataclass
class SyncItem:
    step: int
    name: str
    url: str  # the checkpoint at DST
    action: SyncAction
    bytes: int = 0  # copied (or to copy, on a dry run), or freed
    detail: str | None = None
    layout: str = "ckptctl"  # whose checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "url": self.url, "action": self.action, "bytes": self.bytes,
                "detail": self.detail, "layout": self.layout}


@dataclass
class SyncResult:
    src: str
    dst: str
    dry_run: bool
    items: list[SyncItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def _with(self, *actions: str) -> list[SyncItem]:
        return [i for i in self.items if i.action in actions]

    @property
    def failed(self) -> list[SyncItem]:
        return self._with("failed")

    def to_dict(self) -> dict[str, Any]:
        counts = {a.replace(" ", "_"): len(self._with(a)) for a in
                  ("copied", "present", "deleted", "kept", "skipped", "failed", "would copy", "would delete")}
        return {"src": self.src, "dst": self.dst, "dry_run": self.dry_run, "checkpoints": [i.to_dict() for i in self.items],
                "counts": counts, "bytes": sum(i.bytes for i in self._with("copied", "would copy")),
                "seconds": round(self.seconds, 3), "notes": list(self.notes)}


def _committed(root: Storage) -> list[Checkpoint]:
    """The committed checkpoints of ``root``, of every layout, oldest first."""
    entries = [e for e in list_checkpoints(root) if e.status == "committed" and e.storage is not None]
    return sorted(entries, key=lambda e: (e.step, e.name))


def sync(
    src: Storage,
    dst: Storage,
    *,
    delete: bool = False,
    allow_empty_source: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
    lock_stale_after_s: float = DEFAULT_STALE_AFTER_S,
    command: str = "sync",
) -> SyncResult:
    """Copy every committed checkpoint of ``src`` that ``dst`` lacks (see the module's doc).

    Raises LockHeld (another prune, rm or sync holds DST's lock), StorageError, and
    RefusedForSafety (``delete`` with a source that holds no committed checkpoint); a problem
    with one checkpoint (corrupt source, DST holding a different checkpoint under the same
    name) is a ``failed`` item, and the others go on. A dry run takes no lock, reads no data
    and writes nothing.
    """
    t0 = time.perf_counter()
    result = SyncResult(src.url, dst.url, dry_run)
    sources = _committed(src)
    if delete and not allow_empty_source and not sources:
        # An unmounted volume or a mistyped path reads as an empty root: mirroring it would
        # delete every checkpoint of DST but its newest.
        raise RefusedForSafety(
            f"{src.url} holds no committed checkpoint; `sync --delete` would delete every checkpoint of {dst.url} "
            "but its newest, so nothing was copied or deleted",
            hint="check that SRC_ROOT is the right path and its volume is mounted; pass --allow-empty-source to "
                 "mirror an empty root anyway",
        )
    lock = None if dry_run else RootLock(dst, command=command, stale_after_s=lock_stale_after_s).acquire()
    try:
        if lock is not None:
            result.notes.extend(lock.notes)
        cache = VerifyCache.load(dst, read_only=dry_run)
        have = {e.name: e for e in list_checkpoints(dst)}
        if not dry_run and callable(getattr(progress, "expect", None)):
            expect_bytes(progress, _bytes_to_read(src, sources, dst, have, cache))
        for entry in sources:
            if lock is not None:
                lock.refresh()
            result.items.append(_one(entry, layout_named(entry.layout, src), dst, cache, dry_run, progress,
                                     there=entry.name in have))
        if delete:
            _delete_extra(src, dst, sources, cache, result, lock)
        # Uploads a killed sync (or save) left open in DST's checkpoints (ops.transfer.uploads).
        uploads.in_root(dst, idle_for_s=UPLOAD_IDLE_S, notes=result.notes, dry_run=dry_run)
        if not dry_run:
            cache.retain({e.name for e in list_checkpoints(dst) if e.status in ("committed", "corrupt")})
            cache.save()
            result.notes.extend(cache.notes)
    finally:
        if lock is not None:
            lock.release()
    result.seconds = time.perf_counter() - t0
    return result


def _size(layout: Layout, entry: Checkpoint) -> int:
    """The bytes a copy of ``entry`` reads (what its layout lists to copy; 0 when it cannot tell)."""
    if entry.manifest is not None:
        return sum(f.size for f in entry.manifest.files)
    assert entry.storage is not None
    try:
        return sum(f.size for f in layout.copy_source(entry.storage).files)
    except CheckpointError:
        return 0


def _recorded(cache: VerifyCache, name: str, ckpt: Storage, layout: Layout) -> bool:
    """Whether DST's verification record vouches for the copy ``name`` of ``layout`` as it is now."""
    fp = fingerprint(ckpt, layout)
    return fp is not None and cache.lookup(name, fp, CHECK_LEVEL) is not None


def _bytes_to_read(src: Storage, sources: list[Checkpoint], dst: Storage, have: dict[str, Checkpoint],
                   cache: VerifyCache) -> int:
    """What the sync will read, for a progress bar's total: every checkpoint to copy, and
    every copy at DST to check (those the verification record vouches for cost nothing).
    Only computed for a bar: it lists each DST checkpoint once more."""
    total = 0
    for entry in sources:
        there = have.get(entry.name)
        layout = layout_named(entry.layout, src)
        if there is not None and there.status == "committed" and _recorded(cache, entry.name, dst.sub(entry.name), layout):
            continue
        total += _size(layout, entry)
    return total


def _one(entry: Checkpoint, layout: Layout, dst_root: Storage, cache: VerifyCache, dry_run: bool,
         bar: Progress | None, *, there: bool) -> SyncItem:
    """Mirror one checkpoint; ``there``: DST's listing showed an entry of its name."""
    assert entry.storage is not None
    dst = dst_root.sub(entry.name)
    progress = counting_only(bar)  # the bytes were announced up front (_bytes_to_read)
    item = SyncItem(entry.step, entry.name, dst.url, "failed", layout=entry.layout)
    vouched = False

    def recorded(ckpt: Storage) -> bool:
        nonlocal vouched
        vouched = _recorded(cache, entry.name, ckpt, layout)
        return vouched

    try:
        if dry_run:
            there = layout.copy_committed(layout.copy_source(entry.storage), dst)  # records only: no data read
            if there == "nothing":
                item.action, item.bytes = "would copy", _size(layout, entry)
            else:
                item.action, item.detail = "present", "committed there; its bytes are checked by a real run"
            return item
        copied = copy_in_layout(layout, entry.storage, dst_root, progress=progress, vouched=recorded,
                                expect_present=there)
        if copied.status == "already present":
            item.action = "present"
            item.detail = "unchanged since verified" if vouched else (copied.note or "verified in place")
        else:
            item.action, item.bytes, item.detail = "copied", copied.bytes_copied, copied.note
        fp = fingerprint(dst, layout)
        if fp is not None and not vouched:  # checked on the way: the next sync need not download it again
            cache.record(entry.name, fp, Checked(CHECK_LEVEL, step=entry.step, files=copied.files))
    except NotFound as e:  # pruned at SRC while we looked: nothing to mirror any more
        item.action, item.detail = "skipped", f"gone from SRC during the sync: {e}"
    except (InvalidCheckpoint, RefusedForSafety) as e:
        item.detail = str(e)
    return item


def _delete_extra(src: Storage, dst: Storage, sources: list[Checkpoint], cache: VerifyCache, result: SyncResult,
                  lock: RootLock | None) -> None:
    at_src = {e.name for e in list_checkpoints(src)}
    listed = list_checkpoints(dst)
    guarded = protected(dst, [(e.layout, e.name, "broken" if e.status == "corrupt" else e.status) for e in listed])
    committed = [e for e in _committed(dst) if e.owner is not None]
    by_layout: dict[str, list[Checkpoint]] = {}
    for e in committed:
        by_layout.setdefault(e.layout, []).append(e)
    # DST's newest checkpoint of each layout that verifies is never deleted.
    newest_ok = {_newest_verifying(entries, cache) for entries in by_layout.values()}
    for e in committed:
        if e.name in at_src:
            continue
        assert e.storage is not None and e.owner is not None
        snapshot = entry_snapshot(dst, e.name)
        size = sum(s[1] for s in snapshot if s[3] == "file")
        item = SyncItem(e.step, e.name, e.url, "would delete" if result.dry_run else "deleted", size, layout=e.layout)
        if e.name in newest_ok:
            item.action, item.bytes = "kept", 0
            item.detail = "not in SRC, but DST's newest checkpoint of its layout that verifies: never deleted"
        elif e.name in guarded:
            item.action, item.bytes = "kept", 0
            item.detail = f"not in SRC, but protected ({guarded[e.name]})"
        elif not result.dry_run:
            if lock is not None:
                lock.refresh()
            try:
                changed = remove_entry(dst, e.name, snapshot, e.owner.removal_order, e.owner.commit_files)
                if changed is not None:
                    item.action, item.bytes = "failed", 0
                    item.detail = f"{changed} changed since it was listed; it and the files not yet deleted are left in place"
                else:
                    cache.forget(e.name)
            except OperationalError:
                raise  # the store failing (exit 3), as a copy's storage error is: never "failed" (exit 1)
            except CkptError as err:
                item.action, item.bytes, item.detail = "failed", 0, f"could not delete: {err}"
        result.items.append(item)


def _newest_verifying(entries: list[Checkpoint], cache: VerifyCache) -> str | None:
    """The name of the newest of ``entries`` (one layout's, oldest first) that verifies."""
    for e in reversed(entries):
        assert e.storage is not None and e.owner is not None
        report, _c, fp = verify_cached(e.storage, e.name, cache, layout=e.owner, level=CHECK_LEVEL)
        if report.ok and fp is not None:
            return e.name
    return None


def sync_roots(src: str, dst: str, **options: Any) -> SyncResult:
    """``sync`` by path or URL: SRC must exist; DST is created when missing."""
    return sync(open_root(src), open_storage(dst), command=f"ckptctl sync {src} {dst}", **options)
