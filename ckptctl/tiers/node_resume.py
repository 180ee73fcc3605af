"""What a rank of a job with a node-local first tier reads when it resumes (``load_latest``
through ``tiers.node_chain.NodeTiers``; the choice itself is ``resume``'s).

* **Candidates**: rank 0's node's steps and the later tiers', newest first; with peer replicas,
  every node's steps too (``tiers.node_candidates``), each named once.
* **The view of a candidate** (``tiers.layered``): each file from this node's step directory,
  then the copies of other nodes' files this node holds (the partner's replica, files fetched
  for a resume: ``tiers.replica_store``'s subtree), once ``tiers.replica_recovery`` restored
  what the node lost (with replicas) and ``tiers.node_fetch`` brought what its ranks read from
  the other nodes (with no later tier, or when no later tier holds the step committed: not yet
  promoted), then each later tier. Nothing is trusted for having come from nearby: the loader
  checks every chunk against the manifest it read.
* **Damaged copies**: a shard file the load found damaged is set aside, so that the next
  attempt at the same step reads it from the next copy; every copy of a step is tried before
  an older step is (``docs/protocol.md``, "The recovery choice").
* **Where the files came from**: one INFO line per load, so an operator can tell a resume that
  read its own disk from one that fell back to the partner node or the next tier.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

from ckptctl.errors import CkptError, InvalidCheckpoint
from ckptctl.format.layout import is_own_shard_name
from ckptctl.storage.base import Storage
from ckptctl.tiers.layered import Layered
from ckptctl.tiers.node_candidates import NodeSteps
from ckptctl.tiers.node_fetch import Fetch
from ckptctl.tiers.replica_recovery import Recovery
from ckptctl.tiers.replica_store import replica_dir

log = logging.getLogger("ckptctl")


def name_of(url: str) -> str:
    """The last component of a checkpoint's URL: its step directory's name."""
    return url.rstrip("/").rsplit("/", 1)[-1]


class NodeResume:
    """This rank's reads of the candidates across ``roots`` (the node-local tier first);
    ``recovery`` and ``steps`` only with peer replicas, ``fetch`` only when the job spans
    several nodes and its group is the whole job."""

    def __init__(self, roots: list[Storage], rank: int = 0, recovery: Recovery | None = None,
                 steps: NodeSteps | None = None, fetch: Fetch | None = None) -> None:
        self.roots = roots
        self.rank = rank
        self._recovery = recovery
        self._steps = steps
        self._fetch = fetch
        self._skips: dict[str, dict[str, set[int]]] = {}  # step -> file -> layers whose copy was damaged

    def gather(self) -> None:
        self._skips.clear()
        if self._steps is not None:
            self._steps.gather()

    def candidates(self, listed: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
        """``listed`` (rank 0's node's and the later tiers'), merged with the other nodes'."""
        seen: set[str] = set()
        for tier, name in self._steps.merged(listed) if self._steps is not None else listed:
            if name not in seen:  # one view reads every tier's copy of it
                seen.add(name)
                yield tier, name

    def checkpoint(self, tier: int, name: str) -> Storage:
        if self._recovery is None and self._fetch is None:
            return Layered([root.sub(name) for root in self.roots], self._skips.get(name))
        if tier == 0:  # collective: every rank takes the same candidates in the same order
            if self._recovery is not None:
                source = self._recovery.restore(name)
                if self._fetch is not None and source is not None and self._fetch.needed(name, source):
                    self._fetch.fetch(name, source)
            elif self._fetch is not None and self._fetch.needed(name):
                self._fetch.fetch(name, self._fetch.commit(name))
        layers = [self.roots[0].sub(name), replica_dir(self.roots[0], name), *(r.sub(name) for r in self.roots[1:])]
        return Layered(layers, self._skips.get(name))

    def avoid(self, view: Storage, error: CkptError) -> bool:
        """This rank's load of ``view`` failed with ``error``: set aside the copies of the
        step's shard files it found damaged, so that the next attempt at the same step reads
        each from the next copy. A copy on this node's disk (its step directory, or a replica
        it holds) is renamed hidden in place (``.<name>.damaged``: kept for a look, ignored by
        every reader, removed with its step), so that recovery restores it from the partner
        node, else the next tier serves it; a remote one is skipped by the next view of the
        step. True when it set one aside."""
        if not isinstance(view, Layered) or not isinstance(error, InvalidCheckpoint):
            return False
        text, name = str(error), name_of(view.url)
        bad = [k for k in view.served if is_own_shard_name(k) and view.url_of(k) in text]
        for key in bad:
            i = view.served[key]
            path = view.layers[i].local_path(key)
            if path is None:
                self._skips.setdefault(name, {}).setdefault(key, set()).add(i)
                log.warning("tiers: %s does not check out; the next attempt at %s reads it from another copy",
                            view.layers[i].url_of(key), name)
                continue
            try:
                os.replace(path, os.path.join(os.path.dirname(path), f".{key}.damaged"))
                log.warning("tiers: %s does not check out; set aside as .%s.damaged, the next attempt at %s "
                            "restores it from another copy", view.layers[i].url_of(key), key, name)
            except FileNotFoundError:
                pass  # another rank of this node set it aside already
        return bool(bad)

    def loaded(self, view: Storage) -> None:
        """One INFO line per load: where this rank's files came from (its node's disk, the
        replicas its node holds, the next tiers), so an operator can tell a resume that read
        everything locally from one that fell back to the partner node or S3."""
        if not isinstance(view, Layered) or not view.served:
            return
        by_layer: dict[int, list[str]] = {}
        for key, i in sorted(view.served.items()):
            by_layer.setdefault(i, []).append(key)
        parts = [f"{len(keys)} file{'s' if len(keys) != 1 else ''} from {self._source(view, i)}"
                 + (f" ({', '.join(keys)})" if i > 0 else "")
                 for i, keys in sorted(by_layer.items())]
        log.info("tiers: rank %d loaded %s: %s", self.rank, name_of(view.url), "; ".join(parts))

    def _source(self, view: Layered, layer: int) -> str:
        if layer == 0:
            return f"this node's disk ({view.layers[0].url})"
        if (self._recovery is not None or self._fetch is not None) and layer == 1:
            return f"the copies of other nodes' files on this node ({view.layers[1].url})"
        return view.layers[layer].url
