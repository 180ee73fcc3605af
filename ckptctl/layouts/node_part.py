"""One node's part of a checkpoint: a step on a node-local first tier (``format.node_record``).

Such a root holds, per step, the manifest, the marker and the files of this node's ranks; the
other nodes' files are on their own disks by design. A checkpoint there is judged by what this
node holds: every file of its ranks present and checked, and each file of another rank that is
absent named as living elsewhere, never as missing. A file of this node's ranks that is absent
is missing, as anywhere. Without the root's record nothing is taken to live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint, NotFound
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.node_record import MAX_NODE_RECORD_BYTES, NODE_RECORD, NodeRecord
from ckptctl.storage.base import Storage


def node_record(root: Storage) -> NodeRecord | None:
    """The node record of ``root`` when it is a node's root on a local disk (an object store
    is never a node's tier); None when there is none, or one that does not parse (then every
    file must be there, as on any root)."""
    if root.local_path() is None:
        return None
    try:
        with root.open_reader(NODE_RECORD) as r:
            if r.size > MAX_NODE_RECORD_BYTES:
                return None
            return NodeRecord.from_json(r.read(0, r.size), root.url_of(NODE_RECORD))
    except (NotFound, InvalidCheckpoint):
        return None


@dataclass(frozen=True)
class NodePart:
    """How the files of one checkpoint's manifest divide between this node and the others."""

    record: NodeRecord
    elsewhere: list[FileEntry]  # other ranks' files, absent here

    def note(self, here: int) -> str:
        ranks = sorted({f.rank for f in self.elsewhere})
        return (f"node part: node {self.record.node} (ranks {self.record.ranks_text()}) holds {here} of the "
                f"{here + len(self.elsewhere)} files, all checked; the {len(self.elsewhere)} file(s) of ranks "
                f"{', '.join(map(str, ranks))} live on the other nodes' disks (verify the whole step on the tier "
                "the job promotes to)")


def node_part(ckpt: Storage, manifest: Manifest, record: NodeRecord | None) -> NodePart | None:
    """This node's part of the checkpoint ``ckpt``, or None when it is to be judged whole: no
    record, a manifest of another world size (saved before the job was resized), or nothing
    absent."""
    if record is None or manifest.world_size != record.world_size:
        return None
    elsewhere = [f for f in manifest.files if f.rank not in record.ranks and ckpt.stat(f.name) is None]
    return NodePart(record, elsewhere) if elsewhere else None
