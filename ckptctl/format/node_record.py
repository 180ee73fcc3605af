"""The node record: what makes a root one node's part of a job's node-local first tier.

A node-local first tier (``Tier(path, node_local=True)``) holds on each node only the shards
that node's ranks wrote, plus each checkpoint's manifest and marker. Its root says so in
``.ckptctl-node.json``, written by the node's leader when the job starts (``tiers.node_chain``):

    {"node": "1", "ranks": [2, 3], "world_size": 4}

With it, ``verify``, ``latest``, ``prune`` and ``du`` of the root check what this node holds
against the manifest (the files of ``ranks``) and name the files that live on other nodes,
instead of calling them missing (``layouts.native``); without it, every file a manifest lists
must be there. The name starts with a dot: the catalog never takes it for a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint

NODE_RECORD = ".ckptctl-node.json"
MAX_NODE_RECORD_BYTES = 1 << 20  # a million ranks' numbers fit; anything larger is not ours


@dataclass(frozen=True)
class NodeRecord:
    node: str  # the node's name (torchrun's GROUP_RANK, else the host name)
    ranks: frozenset[int]  # the ranks that ran on it: their files are on this disk
    world_size: int

    def to_json(self) -> bytes:
        return json.dumps({"node": self.node, "ranks": sorted(self.ranks), "world_size": self.world_size}).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "NodeRecord":
        try:
            doc = json.loads(raw)
            node, ranks, world = doc["node"], doc["ranks"], doc["world_size"]
            if not (isinstance(node, str) and isinstance(world, int) and isinstance(ranks, list)
                    and ranks and all(isinstance(r, int) and 0 <= r < world for r in ranks)):
                raise ValueError("fields of the wrong type")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise InvalidCheckpoint(f"{where}: not a node record ({e})",
                                    hint="it is written by a node-local tier; remove it if this root is not one") from None
        return cls(node, frozenset(ranks), world)

    def ranks_text(self) -> str:
        return ", ".join(str(r) for r in sorted(self.ranks))
