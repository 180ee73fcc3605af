"""The node-local commit rule: when a node's first tier counts a checkpoint as committed.

A node-local first tier holds, per step, only the shards its own ranks wrote, plus the
checkpoint's manifest and marker: the exact bytes rank 0 committed on its node, sent to every
other node's leader (the lowest rank of the node) through the tiers channel once the save
committed. The leader writes them only after every shard its node's ranks wrote is in place at
the size the manifest records; the manifest first, the marker last (``layouts.native_commit.commit_copy``),
so the node's copy is committed there exactly when:

* its marker exists and commits its manifest (the checkpoint's own, byte for byte), and
* every file the manifest lists for this node's ranks is there.

Files of other nodes' ranks are absent by design: ``ckptctl verify`` of one node's root names
them as elsewhere (``layouts.node_part``); the checkpoint as a whole is the union of the nodes' roots, and is whole on the
next tier once promoted. The save's own protocol already made the shards durable before rank
0's commit, so the leader checks presence and sizes here, and the bytes when retention is
about to delete something older (``check_node_files``).

May import: ``layouts.native``, ``layouts.shard_scan``, ``layouts.checked``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ckptctl.errors import CheckpointError
from ckptctl.format.layout import MARKER
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.marker import Marker
from ckptctl.layouts.native_commit import commit_copy
from ckptctl.layouts.native_read import Committed, read_committed_raw
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")


def parse_committed(ckpt: Storage, manifest_raw: bytes, marker_raw: bytes) -> Committed:
    """Rank 0's commit as sent, parsed and checked (the marker commits these manifest bytes)."""
    marker = Marker.from_json(marker_raw, ckpt.url_of(MARKER))
    marker.check(manifest_raw, ckpt.url_of(marker.manifest_name))
    return Committed(Manifest.from_json(manifest_raw, ckpt.url_of(marker.manifest_name)), marker, manifest_raw, marker_raw)


def node_files(manifest: Manifest, ranks: Collection[int]) -> list[FileEntry]:
    """The files of ``manifest`` that ``ranks`` (one node's) wrote."""
    return [f for f in manifest.files if f.rank in ranks]


def commit_here(ckpt: Storage, source: Committed, ranks: Collection[int]) -> bool:
    """Commit ``source`` in this node's copy ``ckpt`` when this node's shards are all there.
    Returns whether the node's copy is committed now. Raises StorageError."""
    if ckpt.stat(MARKER) is not None:
        try:
            same = read_committed_raw(ckpt).manifest_raw == source.manifest_raw
        except CheckpointError as e:
            log.error("%s: a marker is already there but does not commit a checkpoint (%s); left as is", ckpt.url, e)
            return False
        if not same:
            log.error("%s already commits another checkpoint of step %d; left as is", ckpt.url, source.manifest.step)
        return same
    for f in node_files(source.manifest, ranks):
        info = ckpt.stat(f.name)
        if info is None or info.kind != "file" or info.size != f.size:
            log.error("%s: %s is %s; this node's copy of step %d is not committed", ckpt.url, f.name,
                      "missing" if info is None else f"{info.size} bytes, not {f.size}", source.manifest.step)
            return False
    commit_copy(ckpt, source)
    return True


def check_node_files(ckpt: Storage, ranks: Collection[int]) -> str | None:
    """Verify this node's copy fully: committed, and every byte of its node's files matches the
    manifest's checksums. None when it does, else why not."""
    try:
        manifest = read_committed_raw(ckpt).manifest
    except CheckpointError as e:
        return str(e)
    for f in node_files(manifest, ranks):
        problems: list[Problem] = []
        header = check_file(ckpt, f, manifest, problems)
        if header is not None:
            problems, _ = stream_file(ckpt, f, header)
        if problems:
            return f"{ckpt.url_of(f.name)}: {problems[0]}"
    return None
