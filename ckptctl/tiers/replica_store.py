"""Where a node keeps its peer replicas (``Tier(..., node_local=True, replicas=1)``), and when
one counts as complete.

A node's first tier holds, beside its own step directories, the shards of its source node
(the node before it in the ring, ``tiers.replica_link``) under one hidden directory::

    <root>/.ckptctl-replicas/step-0000000040/rank-00000-of-00004.safetensors
    <root>/.ckptctl-replicas/step-0000000040/rank-00000.replica      <- marker, written last

The same subtree keeps the files a resume fetched from other nodes (``tiers.node_fetch``, with
or without replicas; no marker: each was checked against the manifest when received).

Why a separate subtree and not the step directory itself: a step directory's files are what
its node's ranks wrote, and the node-local commit rule, ``ckptctl verify`` of a node root and
prune's partial rule all reason about exactly those; a replica written beside them would make
a half-replicated directory look like a node's own partial save. ``ls``, ``prune``,
``verify`` and the catalog skip hidden entries of a root, so the subtree confuses none of
them; node-local retention removes it with its steps (``sweep``).

Each file is written under a temporary name, fsynced and renamed (``Storage.open_writer``),
so a file present here is never a torn write; the per-source marker (``rank-<src>.replica``:
the step, the SHA-256 of the manifest it belongs to and each file's name and size) is written
the same way, last, and only a replica with its marker counts (``complete``): the recovery
of a replaced node is served only from complete replicas. Bytes are not trusted for having
been replicated: the loader checks every chunk against the manifest's checksums, and a
recovery checks each file it restores before it keeps it (``tiers.replica_recovery``).

May import: ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Collection, Sequence

from ckptctl.errors import CkptError
from ckptctl.format.layout import MARKER, parse_step_dir
from ckptctl.format.manifest import FileEntry
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")

REPLICAS = ".ckptctl-replicas"  # hidden: the catalog, ls, prune and verify skip it
MARKER_SUFFIX = ".replica"
MAX_MARKER = 1 << 20


def replica_dir(root: Storage, name: str) -> Storage:
    """The replicas this node holds of checkpoint ``name`` (a step directory's name)."""
    return root.sub(REPLICAS).sub(name)


def marker_name(src_rank: int) -> str:
    return f"rank-{src_rank:05d}{MARKER_SUFFIX}"


def manifest_digest(manifest_raw: bytes) -> str:
    return hashlib.sha256(manifest_raw).hexdigest()


def write_marker(rep: Storage, src_rank: int, step: int, manifest_raw: bytes, files: Sequence[FileEntry]) -> None:
    """Mark the replica of ``src_rank``'s ``files`` complete (after each file was committed)."""
    doc = {"step": step, "source_rank": src_rank, "manifest_sha256": manifest_digest(manifest_raw),
           "files": {f.name: f.size for f in files}}
    rep.write_atomic(marker_name(src_rank), json.dumps(doc, sort_keys=True).encode())


def complete(rep: Storage, src_rank: int, manifest_raw: bytes, files: Sequence[FileEntry]) -> bool:
    """Whether ``rep`` holds a complete replica of ``src_rank``'s ``files`` of exactly this
    checkpoint: its marker names this manifest and these files, each there at its size."""
    try:
        doc = json.loads(rep.read(marker_name(src_rank), max_size=MAX_MARKER))
    except (CkptError, ValueError):  # absent, unreadable or not JSON: no complete replica
        return False
    if not isinstance(doc, dict) or doc.get("manifest_sha256") != manifest_digest(manifest_raw):
        return False
    if doc.get("files") != {f.name: f.size for f in files}:
        return False
    for f in files:
        info = rep.stat(f.name)
        if info is None or info.kind != "file" or info.size != f.size:
            return False
    return True


def remove_replica(root: Storage, name: str) -> bool:
    """Delete the replicas of checkpoint ``name`` on this node: markers first (so an
    interrupted delete never leaves a replica that looks complete), then the files, then the
    directory. Returns whether anything was there. Raises StorageError."""
    rep = replica_dir(root, name)
    items = [i for i in rep.children() if i.kind in ("file", "link")]
    there = bool(items) or root.sub(REPLICAS).stat(name) is not None
    for i in sorted(items, key=lambda i: not i.key.endswith(MARKER_SUFFIX)):
        rep.delete(i.key)
    if there:
        root.sub(REPLICAS).remove_dir(name)
    return there


def sweep(root: Storage, *, delete: Collection[str], anchor_step: int, partial_after_s: float,
          now: float | None = None) -> list[str]:
    """Node-local retention's part for replicas (on the node's leader, after its steps were
    pruned): remove the replicas of the steps in ``delete``; those of steps older than the
    anchor that this node no longer commits (no marker in its step directory) when complete; and any replica (complete or not) older than the anchor left unchanged for
    ``partial_after_s`` whose step this node no longer commits (a round cut short: its
    writer is a thread of another rank of this node, so only idleness shows it has stopped).
    Never a replica of the anchor or a newer step (a round may still be writing it). Returns
    the names removed; a failure is logged and left for the next sweep."""
    now = time.time() if now is None else now
    try:
        entries = root.sub(REPLICAS).children() if root.stat(REPLICAS) is not None else []
    except CkptError as e:
        log.warning("retention of %s: replicas not listed: %s", root.url, e)
        return []
    removed = []
    for e in entries:
        step = parse_step_dir(e.key)
        if e.kind != "dir" or step is None:
            continue  # not ours: never touched
        drop = e.key in delete
        if not drop and step < anchor_step:
            rep = replica_dir(root, e.key)
            try:
                if root.sub(e.key).stat(MARKER) is not None:
                    continue  # this node still holds the step: its replica goes with it
                items = list(rep.list())
                has_marker = any(i.key.endswith(MARKER_SUFFIX) for i in items)
                newest = max([i.mtime for i in items] + [e.mtime])
            except CkptError as err:
                log.warning("retention of %s: replica %s not read: %s", root.url, e.key, err)
                continue
            drop = has_marker or now - newest >= partial_after_s
        if drop:
            try:
                if remove_replica(root, e.key):
                    removed.append(e.key)
            except CkptError as err:
                log.warning("retention of %s: replica %s not removed: %s", root.url, e.key, err)
    if removed:
        log.info("retention of %s: removed the replicas of %s", root.url, ", ".join(removed))
    return removed
