"""The coordinator's last step: build the manifest from every rank's report, write it, then
write the marker. Called only after every shard is durable."""

from __future__ import annotations

import platform
import time
from typing import Any, Sequence

import torch

from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
from ckptctl.format.marker import Marker
from ckptctl.save.shard_writer import ShardReport
from ckptctl.storage.base import Storage
from ckptctl.version import __version__


def build_manifest(step: int, world_size: int, reports: Sequence[ShardReport], tree: dict[str, Any], stats: dict[str, float]) -> Manifest:
    tensors: dict[str, TensorEntry] = {}
    counts: dict[str, int] = {}
    for r in reports:
        for s in r.slots:
            counts[s.name] = counts.get(s.name, 0) + 1
            if s.name not in tensors:
                tensors[s.name] = TensorEntry(s.dtype, s.global_shape, s.group, 0)
    tensors = {n: TensorEntry(t.dtype, t.shape, t.group, counts[n]) for n, t in tensors.items()}
    return manifest_of(step, world_size, [r.file for r in reports], tensors, tree, stats)


def manifest_of(
    step: int, world_size: int, files: Sequence[FileEntry], tensors: dict[str, TensorEntry], tree: dict[str, Any], stats: dict[str, float]
) -> Manifest:
    """The manifest from per-file entries and per-tensor entries: what the coordinator has
    after a multi-rank save (the chunk index stays in each shard's header)."""
    return Manifest(
        step=step,
        created=time.time(),
        world_size=world_size,
        files=sorted(files, key=lambda f: (f.rank, f.name)),
        tensors=dict(sorted(tensors.items())),
        state=tree,
        stats=stats,
        tool={"ckptctl": __version__, "torch": torch.__version__, "python": platform.python_version()},
    )


def commit(ckpt: Storage, manifest: Manifest) -> None:
    """Manifest first, marker last; each written atomically and durably."""
    raw = manifest.to_json()
    ckpt.write_atomic(MANIFEST, raw)
    ckpt.write_atomic(MARKER, Marker.for_manifest(manifest.step, raw).to_json())
