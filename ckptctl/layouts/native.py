"""ckptctl's own layout: reading, committing and deleting one checkpoint on a ``Storage``.

    ROOT/step-0000001000/
        rank-00000-of-00004.safetensors   one shard per writing rank
        manifest.json                     what the checkpoint holds
        COMMITTED                         the marker, written last, never replaced

Nothing a marker commits is ever replaced: every file of a commit is published only under a
name nothing has yet (``Storage.write_if_absent``, ``Writer.publish``), and a name another
attempt at the step already took makes us publish under our attempt's name instead
(``layout.attempt_name``), recorded in the manifest (shards) or the marker (the manifest).
Files of other attempts that the manifest does not name (a dead save's leftovers, a loser's
file published just before it lost) are ignored by every reader and deleted with the step.

A checkpoint is committed when its marker exists, records the size and checksum of the
manifest beside it, and its identity holds: the step in its directory's name (when that is a
step directory), the manifest's step and the marker's step are one number. Anything that
claims to be committed and is not is *corrupt*; a directory without a marker is *partial*.
Every problem in these files is reported as ``InvalidCheckpoint`` (exit 1), never as a storage
error, so that every root-wide verb skips that checkpoint and goes on with the older ones.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

from ckptctl.errors import CheckpointError, InvalidCheckpoint, NotFound, RefusedForSafety, StorageError
from ckptctl.format.layout import (MANIFEST, MARKER, MAX_STEP, attempt_name, is_manifest_name, is_own_shard_name, new_save_id,
                                    parse_step_dir, step_dir)
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import MAX_MARKER_BYTES, Marker
from ckptctl.format.node_record import NodeRecord
from ckptctl.format.shard import ShardHeader, read_header_with
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.copying import AtDestination, ByManifest, CopySource, ToCopy
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split
from ckptctl.layouts.inspected import Inspected, inspect_manifest
from ckptctl.layouts.native_check import check_manifest
from ckptctl.layouts.node_part import node_part, node_record
from ckptctl.layouts.removal import remove_unchanged
from ckptctl.progress import Progress
from ckptctl.storage.local_io import TEMPORARY
from ckptctl.storage.base import ObjectInfo, Storage

NAME = "ckptctl"

log = logging.getLogger("ckptctl")


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint's metadata, parsed and as the exact bytes read: a copy writes
    the same bytes so that its marker still commits its manifest."""

    manifest: Manifest
    marker: Marker
    manifest_raw: bytes
    marker_raw: bytes


@dataclass(frozen=True)
class CommitState:
    """What a checkpoint's marker and manifest say about it, decided from typed results."""

    status: Literal["committed", "partial", "corrupt"]
    committed: Committed | None = None  # when committed
    error: CheckpointError | None = None  # why not: NotFound (partial) or InvalidCheckpoint


# --- reading -------------------------------------------------------------------------------


def read_state(ckpt: Storage) -> CommitState:
    """Committed, partial (no marker) or corrupt (a marker that does not commit a
    self-consistent manifest), from marker and manifest only. Raises only StorageError."""
    try:
        marker_raw = _read_bounded(ckpt, MARKER, MAX_MARKER_BYTES, "a marker may have")
    except NotFound:
        return CommitState("partial", error=NotFound(
            f"{ckpt.url}: no {MARKER} marker, so the checkpoint is not committed",
            hint="it is still being written or its save failed; use an older checkpoint",
        ))
    except InvalidCheckpoint as e:
        return CommitState("corrupt", error=e)
    try:
        return CommitState("committed", _committed(ckpt, marker_raw))
    except InvalidCheckpoint as e:
        return CommitState("corrupt", error=e)


def read_committed_raw(ckpt: Storage) -> Committed:
    """Marker, then the manifest it commits, parsed and raw. Raises NotFound (no marker: not
    committed) or InvalidCheckpoint (garbled, mismatched, or its identity does not hold)."""
    state = read_state(ckpt)
    if state.error is not None:
        raise state.error
    assert state.committed is not None
    return state.committed


def read_committed(ckpt: Storage) -> tuple[Manifest, Marker]:
    """``read_committed_raw`` without the raw bytes."""
    committed = read_committed_raw(ckpt)
    return committed.manifest, committed.marker


def read_header(ckpt: Storage, name: str) -> ShardHeader:
    """Parse one shard's safetensors header with at most two small ranged reads."""
    with ckpt.open_reader(name) as r:
        return read_header_with(r.read, r.size, ckpt.url_of(name))


def total_size(ckpt: Storage) -> tuple[int, float]:
    """Bytes and newest mtime of everything in a checkpoint directory (links not followed)."""
    size, newest = 0, 0.0
    for info in ckpt.list():
        item: ObjectInfo = info
        size += item.size if item.kind == "file" else 0
        newest = max(newest, item.mtime)
    return size, newest


def dir_step(ckpt: Storage) -> int | None:
    """The step ``ckpt``'s own directory name stands for, or None when it is not a step
    directory (a copy under a name of the user's choosing, a staging directory)."""
    path = ckpt.local_path()
    name = os.path.basename(os.path.abspath(path)) if path is not None else ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    return parse_step_dir(name)


def _read_bounded(ckpt: Storage, key: str, limit: int, limit_is: str) -> bytes:
    # Not Storage.read: its size guard is an operational error (exit 3), and an oversized
    # marker or manifest is a property of this checkpoint, to be skipped like any corruption.
    with ckpt.open_reader(key) as r:
        if r.size > limit:
            raise InvalidCheckpoint(
                f"{ckpt.url_of(key)}: {r.size} bytes, more than the {limit} {limit_is}",
                hint="it was changed or replaced after commit; do not resume from this checkpoint",
            )
        return r.read(0, r.size)


def _committed(ckpt: Storage, marker_raw: bytes) -> Committed:
    # The parsers are the one validated layer (format.parse): they bound every field (the
    # manifest size a marker records included) and raise only InvalidCheckpoint.
    marker = Marker.from_json(marker_raw, ckpt.url_of(MARKER))
    name = marker.manifest_name  # a plain manifest name: Marker.from_json checked it
    try:
        raw = _read_bounded(ckpt, name, marker.manifest_size, "bytes its marker records")
    except NotFound:
        raise InvalidCheckpoint(
            f"{ckpt.url}: marker present but {name} is missing",
            hint="the checkpoint was damaged after commit; do not resume from it",
        ) from None
    marker.check(raw, ckpt.url_of(name))
    manifest = Manifest.from_json(raw, ckpt.url_of(name))
    _check_identity(ckpt, manifest, marker)
    return Committed(manifest, marker, raw, marker_raw)


def _check_identity(ckpt: Storage, manifest: Manifest, marker: Marker) -> None:
    """Directory step (when it is a step directory) == manifest step == marker step, in range:
    a checkpoint copied or renamed under another step's name must never pass for that step."""
    named = dir_step(ckpt)
    in_range = all(0 <= s <= MAX_STEP for s in (manifest.step, marker.step))
    if in_range and manifest.step == marker.step and named in (None, manifest.step):
        return
    shown = "is not a step directory" if named is None else f"says step {named}"
    raise InvalidCheckpoint(
        f"{ckpt.url}: directory name {shown}, manifest says step {manifest.step}, marker says step "
        f"{marker.step}; they must agree",
        hint="it was renamed or copied by hand, or damaged; do not resume from it "
        "(`ckptctl cp` puts a checkpoint in its own step's directory)",
    )


# --- writing -------------------------------------------------------------------------------


def check_target_name(ckpt: Storage, step: int) -> None:
    """Refuse to write step ``step`` into a directory named for another step: the result
    would be corrupt (its identity would not hold), or worse, taken for that other step."""
    named = dir_step(ckpt)
    if named is not None and named != step:
        raise RefusedForSafety(
            f"{ckpt.url} is the directory of step {named}; refusing to write step {step} into it",
            hint=f"write it to a directory named {step_dir(step)}, or give the root as the "
            "destination (the step's directory is made below it)",
        )


def commit(ckpt: Storage, manifest: Manifest, *, published: Sequence[str] = ()) -> str:
    """Commit ``ckpt`` once every shard is durable: the manifest, then the marker, each
    published only where nothing has its name, so nothing of a committed step is ever
    replaced. The manifest goes to ``manifest.json``, or to ``manifest.<save id>.json`` when
    another attempt at this step took that name (the marker then names it). Returns the
    manifest's name.

    When the marker is there already, or another writer's lands first, raises
    RefusedForSafety naming the URL, leaving that writer's files untouched; first this save's
    own files are deleted by their exact names (its manifest and ``published``, the shards it
    published with ``Writer.publish``), except any the winner's manifest names: a copy may have
    found one of them holding its own bytes and used it (``ops.transfer.engine``)."""
    step = manifest.step
    check_target_name(ckpt, step)
    # Looked at first so that a writer far behind (a zombie) writes no manifest into a
    # committed step; write_if_absent on the marker settles any race after this look.
    if ckpt.stat(MARKER) is not None:
        _discard(ckpt, published)
        raise _other_writer(ckpt, step)
    raw = manifest.to_json()
    name = MANIFEST
    if not ckpt.write_if_absent(name, raw):  # another attempt's: never replaced, never deleted
        name = attempt_name(MANIFEST, manifest.save_id or new_save_id())
        if not ckpt.write_if_absent(name, raw):
            # No marker decided the step yet, so nothing of this save is deleted: another
            # writer may be using a shard it published (see ``_discard``).
            raise RefusedForSafety(
                f"{ckpt.url}: {MANIFEST} and {name} both exist; this save of step {step} was not committed",
                hint="another writer is saving this step under the same save id; stop the other job",
            )
    marker_raw = Marker.for_manifest(step, raw, name).to_json()
    if not ckpt.write_if_absent(MARKER, marker_raw):
        if _holds(ckpt, MARKER, marker_raw):
            return name  # ours after all: a retried request that had landed the first time
        _discard(ckpt, [*published, name])
        raise _other_writer(ckpt, step)
    return name


def commit_copy(ckpt: Storage, source: Committed, published: Sequence[str] = ()) -> None:
    """Commit a copy with the exact bytes of another checkpoint's manifest (under the name its
    marker gives) and marker, once every file it names is in place and proven: the manifest,
    then the marker, each written only where nothing has its name. A name that already holds
    exactly these bytes is this checkpoint's (a copy of it run again, or two at once), so a
    copy of the same checkpoint that finds it committed succeeds too.

    Raises RefusedForSafety when another writer took the step: its marker is there or lands
    first (then the files this copy ``published`` that the winner's manifest does not name are
    deleted), or the manifest's name holds other bytes (nothing is deleted then: no marker has
    decided the step yet, and another writer may be using what this copy published)."""
    step = source.manifest.step
    check_target_name(ckpt, step)
    name = source.marker.manifest_name
    if ckpt.stat(MARKER) is not None:
        if _holds(ckpt, MARKER, source.marker_raw) and _holds(ckpt, name, source.manifest_raw):
            return  # this very checkpoint, committed by another copy of it (or an earlier run)
        _discard(ckpt, published)
        raise _other_writer(ckpt, step)
    if not ckpt.write_if_absent(name, source.manifest_raw) and not _holds(ckpt, name, source.manifest_raw):
        raise RefusedForSafety(
            f"{ckpt.url_of(name)} already exists and is another checkpoint's manifest: another writer is "
            f"writing step {step} here (or a killed one left it); nothing was replaced and this copy was not committed",
            hint="let the other writer finish; if none is running, remove the partial step "
            f"(`ckptctl rm {ckpt.url} --force`) and copy again",
        )
    if not ckpt.write_if_absent(MARKER, source.marker_raw):
        if _holds(ckpt, MARKER, source.marker_raw):
            return  # ours after all, or a twin copy's: the same checkpoint either way
        _discard(ckpt, [*published, name])
        raise _other_writer(ckpt, step)


def _holds(ckpt: Storage, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` (read back bounded by its length)."""
    try:
        with ckpt.open_reader(key) as r:
            return r.size == len(data) and r.read(0, r.size) == data
    except (NotFound, InvalidCheckpoint):
        return False


def _discard(ckpt: Storage, names: Iterable[str]) -> None:
    """After losing the step to another writer's marker, delete the files this writer
    published (``names``, exact), except those the winner's committed manifest names: a copy
    that found one of them holding exactly its own bytes used it instead of writing its own
    (``ops.transfer.engine``), so deleting it would break the committed checkpoint. When the
    winner's commit cannot be read, nothing is deleted. A failure is logged, not raised: the
    refusal is the outcome that matters, and a file left behind is not named by the winner's
    manifest, so it is harmless."""
    state = read_state(ckpt)
    if state.committed is None:
        log.warning("%s: the other writer's commit cannot be read (%s); this writer's files are left", ckpt.url, state.error)
        return
    kept = {state.committed.marker.manifest_name, *(f.name for f in state.committed.manifest.files)}
    for name in names:
        if name in kept:
            continue
        try:
            ckpt.delete(name)
        except (StorageError, InvalidCheckpoint) as e:
            log.warning("could not delete %s after losing the step to another writer: %s", ckpt.url_of(name), e)


def _other_writer(ckpt: Storage, step: int) -> RefusedForSafety:
    return RefusedForSafety(
        f"{ckpt.url_of(MARKER)} already exists: another writer committed step {step} here; "
        "this one's marker was not written",
        hint="two jobs are saving into one root (a zombie job and its restart?); stop the other "
        "one and check this step with `ckptctl verify`",
    )


def uncommit(ckpt: Storage) -> None:
    """Remove the marker only: the checkpoint reads as partial from then on."""
    ckpt.delete(MARKER)


def removal_order(keys: Iterable[str]) -> list[str]:
    """Keys in the order a delete takes them: the marker, then the manifest(s), then the rest,
    so that a delete cut short leaves something that reads as partial, never as committed."""
    return sorted(keys, key=lambda k: (0 if k == MARKER else 1 if is_manifest_name(k) else 2, k))


def remove(ckpt: Storage, *, expected: Mapping[str, tuple[int, float]] | None = None) -> str | None:
    """Delete one checkpoint: the marker first, so that a removal interrupted at any point
    leaves something that reads as partial, never as committed; then the manifest, the rest
    and the directory (when empty).

    With ``expected`` (key -> (size, mtime), as a prune plan saw them) only those files are
    deleted, each only while unchanged: the URL of the first that changed is returned, and it
    and the files after it stay. Returns None when everything asked for was deleted.
    """
    if expected is not None:
        return remove_unchanged(ckpt, removal_order(expected), expected)
    uncommit(ckpt)
    for info in list(ckpt.list()):
        ckpt.delete(info.key)
    ckpt.remove_dir("")
    return None


# A POSIX writer streams into ``.NAME.tmp-PID-RANDOM`` and renames it into place on commit
# (storage/local_io.py); a writer killed mid-file leaves that temporary behind.
_TEMPORARY = TEMPORARY  # the writer's own pattern (storage.local_io): one pattern for every leftover


# --- as a layout ---------------------------------------------------------------------------


def _padded(ckpt: Storage) -> bool:
    path = ckpt.local_path()
    name = os.path.basename(os.path.abspath(path)) if path is not None else ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        return name == step_dir(int(name.split("-", 1)[1]))
    except (IndexError, ValueError):
        return False


class NativeLayout:
    """ckptctl's own layout: ``step-NNNNNNNNNN`` directories with a marker, checked against
    the manifest the marker commits (``native_check``)."""

    name = NAME
    title = "ckptctl"
    files_are_checkpoints = False
    pointer_file: str | None = None  # load_latest walks the root; no pointer file names a step
    # Why ``seal`` leaves these alone: the manifest already is what a seal would be.
    seal_note: str | None = "a ckptctl checkpoint: its manifest already records a checksum for every byte; no seal needed"
    commit_marker: str | None = MARKER  # no marker: partial; a marker: committed or corrupt
    commit_files: tuple[str, ...] = (MARKER, MANIFEST)  # the marker, and the manifest it commits

    # --- recognise and step

    # Bound to a node's root of a node-local tier (``layouts.node_part``): its record; else None.
    node: NodeRecord | None = None

    def for_root(self, root: Storage) -> "NativeLayout":
        record = node_record(root)
        if record is None:
            return self
        bound = copy.copy(self)
        bound.node = record
        return bound

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind not in ("dir", "link"):
            return None
        return parse_step_dir(child.key.rsplit("/", 1)[-1])

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Ours when it holds a marker, a manifest, a shard named as we name them, or a
        temporary of one; an empty directory only under our own padded name (a save that
        made its directory and died). ``step-N`` is torchtitan's name too."""
        for name in names:
            m = _TEMPORARY.match(name)
            base = m.group(1) if m is not None else name
            if base == MARKER or is_manifest_name(base) or is_own_shard_name(base):
                return True
        return not names and dir_step(ckpt) is not None and _padded(ckpt)

    def claims_alone(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Ours under any name (a ``cp`` destination) by the same files."""
        return bool(names) and self.claims(ckpt, names)

    # --- commit rule and removal

    def examine(self, ckpt: Storage) -> Examined:
        state = read_state(ckpt)
        if state.committed is not None:
            return Examined("committed", None, state.committed.manifest)
        # A partial checkpoint's reason is the absence of a marker, said by its status.
        reason = None if state.status == "partial" else str(state.error)
        return Examined(state.status, reason)

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        return removal_order(keys)

    # --- checking and inspecting

    def check(self, ckpt: Storage, level: Level, *, split: Split = ALONE, progress: Progress | None = None) -> Checked:
        state = read_state(ckpt)
        committed, error = state.committed, state.error
        problem = Problem(str(error), hint=error.hint) if error is not None else None
        part = node_part(ckpt, committed.manifest, self.node) if committed else None
        return check_manifest(ckpt, level, committed.manifest if committed else None,
                              committed.marker.manifest_checksum if committed else None, problem,
                              split=split, progress=progress, part=part)

    def reads_on_resume(self, rel: str) -> bool:
        return True  # the manifest names every shard, and a resume reads every one it names

    def identity(self, ckpt: Storage) -> str | None:
        """The manifest checksum the marker records; None when there is no readable marker."""
        try:
            marker_raw = _read_bounded(ckpt, MARKER, MAX_MARKER_BYTES, "a marker may have")
            return Marker.from_json(marker_raw, ckpt.url_of(MARKER)).manifest_checksum
        except (NotFound, InvalidCheckpoint):
            return None

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> Inspected:
        manifest, _ = read_committed(ckpt)
        kind = manifest_kind(manifest)
        return inspect_manifest(ckpt.url, manifest, kind.kind, kind.reason, tensors=tensors)

    # --- pointers: none, ``load_latest`` walks the root

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        return None

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        return None

    # --- copying (``layouts.copying``; the engine is ``ops.transfer.engine``)

    def copy_source(self, ckpt: Storage) -> CopySource:
        """The shards, each proven by the manifest as it streams; the manifest and marker are
        the record, written by ``commit_copy`` with the exact bytes read, last."""
        committed = read_committed_raw(ckpt)
        m = committed.manifest
        return CopySource(step_dir(m.step), m.step, files_to_copy(m), committed, committed.manifest_raw,
                          world_size=m.world_size)

    def copy_committed(self, source: CopySource, dst: Storage) -> AtDestination:
        check_target_name(dst, source.step)
        if dst.stat(MARKER) is None:
            return "nothing"
        try:
            existing = read_committed_raw(dst)
        except CheckpointError as e:
            raise RefusedForSafety(
                f"{dst.url} already has a {MARKER} marker but is not a valid checkpoint ({e})",
                hint=f"inspect it with `ckptctl verify {dst.url}`; remove it (marker first) to replace it",
            ) from None
        if existing.manifest_raw != source.identity:
            raise RefusedForSafety(
                f"{dst.url} already holds a different committed checkpoint (step {existing.manifest.step})",
                hint="choose another destination, or delete that checkpoint first",
            )
        return "this"

    def uncommit_copy(self, source: CopySource, dst: Storage) -> None:
        uncommit(dst)

    def commit_copy(self, source: CopySource, dst: Storage, published: Sequence[str] = ()) -> None:
        committed = source.record
        assert isinstance(committed, Committed)
        commit_copy(dst, committed, published)

    def pointer_after_copy(self, source: CopySource) -> tuple[str, bytes] | None:
        return None  # load_latest walks the root: no pointer names a step

    def pointer_step(self, raw: bytes) -> int | None:
        return None

    def assuming_pointer(self, name: str, step: int) -> "NativeLayout":
        return self

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {}

    # --- resume and metrics

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        if manifest is None:
            state = read_state(ckpt)
            if state.committed is None:  # not committed: verify says why; nothing to tell here
                return CheckpointKind("resumable", "not committed, so not told apart")
            manifest = state.committed.manifest
        return manifest_kind(manifest)

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, "Checkpointer(ROOT).load_latest(state), or Checkpointer.load(PATH, state)",
                      (ckpt_path,))

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        return {}  # a save's metrics are in its manifest, which the catalog has read already


def files_to_copy(manifest: Manifest) -> tuple[ToCopy, ...]:
    """The shards of the checkpoint ``manifest`` describes, as a copy writes them: each proven
    by the manifest (header, every chunk, the file checksum) and read by its own rank."""
    return tuple(ToCopy(f.name, f.size, ByManifest(f, manifest), ranks=frozenset({f.rank})) for f in manifest.files)


def manifest_kind(manifest: Manifest) -> CheckpointKind:
    """Resumable or export, from the roles the manifest records: each tensor's group says
    whether it came from a module ("model"), an optimizer ("optimizer") or anything else."""
    optimizers = sorted({name.split("/", 1)[0] for name, t in manifest.tensors.items() if t.group == "optimizer"})
    # An optimizer that has not stepped yet has no tensors, only its param_groups (state/capture.py).
    optimizers += sorted(k for k, v in manifest.state.items() if k not in optimizers and isinstance(v, dict)
                         and isinstance(v.get("param_groups"), list) and isinstance(v.get("state"), dict))
    if optimizers:
        return CheckpointKind("resumable", f"holds optimizer state ({', '.join(optimizers[:3])})")
    if any(t.group == "model" for t in manifest.tensors.values()):
        modules = sorted({name.split("/", 1)[0] for name, t in manifest.tensors.items() if t.group == "model"})
        return CheckpointKind("export", f"model only: {', '.join(modules[:3])} saved without an optimizer")
    # No module at all: plain tensors and values, whose purpose the manifest does not record.
    return CheckpointKind("resumable", "no module and no optimizer (plain tensors and values): not told apart")
