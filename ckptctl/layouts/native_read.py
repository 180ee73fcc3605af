"""Reading one checkpoint of ckptctl's own format: its marker, the manifest the marker
commits, shard headers, and whether the checkpoint is committed, partial or corrupt.

A checkpoint is committed when its marker exists, records the size and checksum of the
manifest beside it, and its identity holds: the step in its directory's name (when that is a
step directory), the manifest's step and the marker's step are one number. Anything that
claims to be committed and is not is *corrupt*; a directory without a marker is *partial*.
Every problem in these files is reported as ``InvalidCheckpoint`` (exit 1), never as a storage
error, so that every root-wide verb skips that checkpoint and goes on with the older ones.
(The layout itself: ``layouts.native``; writing and removing: ``layouts.native_commit``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ckptctl.errors import CheckpointError, InvalidCheckpoint, NotFound
from ckptctl.format.layout import MARKER, MAX_STEP, parse_step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import MAX_MARKER_BYTES, Marker
from ckptctl.format.shard import ShardHeader, read_header_with
from ckptctl.storage.base import ObjectInfo, Storage


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
        marker_raw = read_bounded(ckpt, MARKER, MAX_MARKER_BYTES, "a marker may have")
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


def read_bounded(ckpt: Storage, key: str, limit: int, limit_is: str) -> bytes:
    # Not Storage.read: its size guard is an operational error (exit 3), and an oversized
    # marker or manifest is a property of this checkpoint, to be skipped like any corruption.
    # One request on object storage, an over-long file refused unread (``read_if_small``).
    data, size = ckpt.read_if_small(key, limit)
    if data is None:
        raise InvalidCheckpoint(
            f"{ckpt.url_of(key)}: {size} bytes, more than the {limit} {limit_is}",
            hint="it was changed or replaced after commit; do not resume from this checkpoint",
        )
    return data


def _committed(ckpt: Storage, marker_raw: bytes) -> Committed:
    # The parsers are the one validated layer (format.parse): they bound every field (the
    # manifest size a marker records included) and raise only InvalidCheckpoint.
    marker = Marker.from_json(marker_raw, ckpt.url_of(MARKER))
    name = marker.manifest_name  # a plain manifest name: Marker.from_json checked it
    try:
        raw = read_bounded(ckpt, name, marker.manifest_size, "bytes its marker records")
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
