"""ckptctl's own format as a ``Layout`` (``NativeLayout``): recognising, checking, inspecting,
copying and resuming its checkpoints.

    ROOT/step-0000001000/
        rank-00000-of-00004.safetensors   one shard per writing rank
        manifest.json                     what the checkpoint holds
        COMMITTED                         the marker, written last, never replaced

Reading one checkpoint (committed, partial or corrupt) is ``layouts.native_read``; committing
and removing one, without ever replacing what a marker commits, is ``layouts.native_commit``;
checking its bytes is ``layouts.native_check``.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Iterable, Sequence

from ckptctl.errors import CheckpointError, InvalidCheckpoint, NotFound, RefusedForSafety
from ckptctl.format.layout import MANIFEST, MARKER, is_manifest_name, is_own_shard_name, parse_step_dir, step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import MAX_MARKER_BYTES, Marker
from ckptctl.format.node_record import NodeRecord
from ckptctl.layouts.base import CheckpointKind, Examined, Numbering, Resume
from ckptctl.layouts.copying import AtDestination, ByManifest, CopySource, ToCopy
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split
from ckptctl.layouts.inspected import Inspected, inspect_manifest
from ckptctl.layouts.native_check import check_manifest
from ckptctl.layouts.native_commit import check_target_name, commit_copy, manifest_ahead, removal_order, uncommit
from ckptctl.layouts.native_read import Committed, dir_step, read_bounded, read_committed, read_committed_raw, read_state
from ckptctl.layouts.node_part import node_part, node_record
from ckptctl.progress import Progress
from ckptctl.storage.local_io import TEMPORARY
from ckptctl.storage.base import ObjectInfo, Storage

NAME = "ckptctl"

log = logging.getLogger("ckptctl")


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

    def numbered_by(self, name: str) -> Numbering:
        return "step"  # the step the save was given: the manifest and marker record it too

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Ours when it holds a marker, a manifest, a shard named as we name them, or a
        temporary of one; an empty directory only under our own padded name (a save that
        made its directory and died). ``step-N`` is torchtitan's name too."""
        for name in names:
            # A POSIX writer killed mid-file leaves ``.NAME.tmp-PID-RANDOM`` (storage.local_io's pattern).
            m = TEMPORARY.match(name)
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
            marker_raw = read_bounded(ckpt, MARKER, MAX_MARKER_BYTES, "a marker may have")
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

    def copy_ahead(self, source: CopySource, dst: Storage) -> tuple[str, ...]:
        """The manifest, before the data: without the marker it commits nothing."""
        committed = source.record
        assert isinstance(committed, Committed)
        return (committed.marker.manifest_name,) if manifest_ahead(dst, committed) else ()

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
