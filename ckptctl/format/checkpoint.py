"""Reading one checkpoint's metadata: marker, manifest and shard headers, all defensive.

Knows bytes and paths only; the torch side of reading lives in ``ckptctl.load``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from ckptctl.errors import InvalidCheckpoint, NotFound
from ckptctl.format.layout import MANIFEST, MARKER, parse_step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import Marker
from ckptctl.format.shard import MAX_HEADER_BYTES, ShardHeader, header_length, parse_header
from ckptctl.storage.base import ObjectInfo, Storage

Status = Literal["committed", "partial", "corrupt"]


def read_committed(ckpt: Storage) -> tuple[Manifest, Marker]:
    """Marker, then the manifest it commits. Raises NotFound (no marker: not committed) or
    InvalidCheckpoint (garbled, or the manifest does not match its marker)."""
    committed = read_committed_raw(ckpt)
    return committed.manifest, committed.marker


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint's metadata, parsed and as the exact bytes read: a copy writes
    the same bytes so that its marker still commits its manifest."""

    manifest: Manifest
    marker: Marker
    manifest_raw: bytes
    marker_raw: bytes


def read_committed_raw(ckpt: Storage) -> Committed:
    """``read_committed``, keeping the raw bytes of both files."""
    where = ckpt.url
    try:
        marker_raw = ckpt.read(MARKER, max_size=1 << 20)
    except NotFound:
        raise NotFound(
            f"{where}: no {MARKER} marker, so the checkpoint is not committed",
            hint="it is still being written or its save failed; use an older checkpoint",
        ) from None
    marker = Marker.from_json(marker_raw, ckpt.url_of(MARKER))
    try:
        raw = ckpt.read(MANIFEST, max_size=max(marker.manifest_size, 1) + 1)
    except NotFound:
        raise InvalidCheckpoint(
            f"{where}: marker present but {MANIFEST} is missing",
            hint="the checkpoint was damaged after commit; do not resume from it",
        ) from None
    marker.check(raw, ckpt.url_of(MANIFEST))
    return Committed(Manifest.from_json(raw, ckpt.url_of(MANIFEST)), marker, raw, marker_raw)


def read_header(ckpt: Storage, name: str) -> ShardHeader:
    """Parse one shard's safetensors header with at most two small ranged reads."""
    where = ckpt.url_of(name)
    with ckpt.open_reader(name) as r:
        n = header_length(r.read(0, min(8, r.size)), r.size, where)
        # One read usually gets the header whole; headers are small next to the data.
        head = r.read(0, 8 + min(n, MAX_HEADER_BYTES))
        return parse_header(head, r.size, where)


@dataclass(frozen=True)
class StepEntry:
    """A step directory under a root, as listed (before anything inside it is read)."""

    step: int
    name: str
    kind: str  # "dir" or "link" (a symlink is never followed)


def list_steps(root: Storage) -> list[StepEntry]:
    """Step directories under ``root``, oldest first, compared as integers."""
    out = []
    for info in root.children():
        step = parse_step_dir(info.key.rsplit("/", 1)[-1])
        if step is not None and info.kind in ("dir", "link"):
            out.append(StepEntry(step, info.key, info.kind))
    out.sort(key=lambda e: (e.step, e.name))
    return out


def status_of(ckpt: Storage) -> tuple[Status, str | None]:
    """Cheap status from marker and manifest only: committed, partial (no marker) or corrupt
    (marker present but it and the manifest disagree). The second item says why."""
    try:
        read_committed(ckpt)
    except NotFound as e:
        if "marker" in str(e) and ckpt.stat(MARKER) is None:
            return "partial", None
        return "corrupt", str(e)
    except InvalidCheckpoint as e:
        return "corrupt", str(e)
    return "committed", None


def iter_marked(root: Storage) -> Iterator[tuple[StepEntry, Storage]]:
    """Step directories that hold a marker (committed, or claiming to be), newest first, lazily:
    one listing, then one marker lookup per checkpoint actually taken, so "the newest that
    verifies" under thousands of checkpoints (S3: a HEAD each) stays cheap."""
    for e in reversed(list_steps(root)):
        if e.kind == "dir" and root.sub(e.name).stat(MARKER) is not None:
            yield e, root.sub(e.name)


def newest_committed(root: Storage) -> list[tuple[StepEntry, Storage]]:
    """Committed checkpoints, newest first (marker matches manifest; contents not verified)."""
    out = []
    for e in reversed(list_steps(root)):
        if e.kind != "dir":
            continue
        sub = root.sub(e.name)
        if status_of(sub)[0] == "committed":
            out.append((e, sub))
    return out


def total_size(ckpt: Storage) -> tuple[int, float]:
    """Bytes and newest mtime of everything in a checkpoint directory (links not followed)."""
    size, newest = 0, 0.0
    for info in ckpt.list():
        item: ObjectInfo = info
        size += item.size if item.kind == "file" else 0
        newest = max(newest, item.mtime)
    return size, newest
