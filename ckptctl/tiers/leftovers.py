"""Abandoned partial step directories of one tier, removed by ``ckptctl prune``'s own rules.

Two places leave step directories without a marker that nothing else cleans up:

* a node-local first tier (``tiers.node_retention``): a save that failed or was killed on that
  node, or a node's copy whose commit never came; ``prune`` cannot run on one node's root
  (its anchor never verifies there: other nodes' files are absent by design);
* the tier after it (``tiers.promotion_round``): a round whose rank was killed, failed, or
  whose step was given up or skipped for a newer one, leaving shard objects and open multipart
  uploads, no marker.

Neither writes deletion code of its own. ``abandoned`` is prune's survey (``ops.retention.plan``):
an entry is a candidate only when ckptctl's layout names it and calls it partial (no marker),
never when another layout's rule calls it complete (the catalog lists it as unknown), never a
symlink; it is deleted only once nothing inside was modified for ``partial_after_s`` (prune's
``--partial-after``, 6 h by default). ``remove`` is prune's ``execute`` under the root's lock:
each entry re-listed and deleted only while exactly as surveyed, file by file, marker (then
manifest) first, everything through the ``Storage`` rooted at the tier, so nothing outside
it is touched. Both need an anchor, as prune does: the caller's newest committed checkpoint,
verified by the caller (a node's part byte for byte; the promotion a round just committed).

The one rule a caller may relax is the idle time, for directories it knows no writer of its
own still writes (``quiet``): a promotion round that every rank answered. Unfinished multipart
uploads are aborted first, by ``ops.transfer.uploads``' rules, so none completes into a
directory after it was removed.

May import: ``ops.retention``, ``ops.verify.cache``, ``ops.transfer.uploads``, ``layouts``,
``storage``, leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

from ckptctl.errors import CkptError
from ckptctl.format.layout import parse_step_dir
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, list_checkpoints
from ckptctl.ops.retention.execute import execute
from ckptctl.ops.lock import RootLock
from ckptctl.ops.retention.plan import DEFAULT_PARTIAL_AFTER_S, PlanItem, PrunePlan
from ckptctl.ops.retention.plan import survey  # prune's classification of one entry, not a copy of it
from ckptctl.ops.retention.policies import KeepLast, RetentionPolicy
from ckptctl.ops.verify.cache import fingerprint
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")

PARTIAL_AFTER_S = DEFAULT_PARTIAL_AFTER_S  # prune's default --partial-after, so one bound for both


def abandoned(root: Storage, *, partial_after_s: float = PARTIAL_AFTER_S, quiet: Collection[str] = (),
              keep: Collection[str] = (), below: int | None = None, now: float | None = None) -> list[PlanItem]:
    """The partial step directories of ckptctl's layout under ``root`` that prune would delete
    as abandoned, oldest first: idle for ``partial_after_s`` (0 for the names in ``quiet``).
    Never the names in ``keep``, nor a step at or above ``below`` when given. Raises
    StorageError (listing)."""
    now = time.time() if now is None else now
    found = []
    for entry in list_checkpoints(root, layouts=CHECKPOINTER_LAYOUTS):  # another layout's, or complete by its rule: unknown
        if entry.status != "partial" or entry.name in keep or (below is not None and entry.step >= below):
            continue
        item = survey(root, entry, now, 0.0 if entry.name in quiet else partial_after_s)
        if item.kind == "partial" and item.action == "delete":
            found.append(item)
    return found


def remove(root: Storage, anchor: str, items: Sequence[PlanItem], *, command: str,
           partial_after_s: float = PARTIAL_AFTER_S) -> list[str]:
    """Delete ``items`` (from ``abandoned``) with prune's ``execute`` under the root's lock,
    ``anchor`` (the newest committed checkpoint's name, verified by the caller) as the plan's
    anchor. Returns the names deleted; what changed meanwhile is left and logged. Raises
    LockHeld (a prune runs) or StorageError."""
    if not items:
        return []
    layout = CHECKPOINTER_LAYOUTS[0]
    step = parse_step_dir(anchor)
    kept = PlanItem(step if step is not None else 0, anchor, root.url_of(anchor), "committed", "keep",
                    "the newest committed checkpoint, verified before any deletion", layout=layout.name,
                    owner=layout, fingerprint=fingerprint(root.sub(anchor), layout))
    p = PrunePlan(root, RetentionPolicy.of(KeepLast(1)), partial_after_s, delete_broken=False, reverify=False,
                  now=time.time(), items=list(items), anchor=kept, anchors={layout.name: kept},
                  managed={layout.name: layout})
    with RootLock(root, command=command) as lock:
        outcome = execute(p, lock=lock)
    for o in outcome.failed + outcome.skipped:
        log.warning("%s: %s %s: %s", command, o.result, root.url_of(o.name), o.detail)
    deleted = [o.name for o in outcome.deleted]
    if deleted:
        log.info("%s: deleted abandoned partial %s under %s", command, ", ".join(deleted), root.url)
    return deleted


def sweep(root: Storage, anchor: str, *, command: str, partial_after_s: float = PARTIAL_AFTER_S,
          quiet: Collection[str] = (), keep: Collection[str] = (), below: int | None = None) -> list[str]:
    """``abandoned`` then ``remove``; a failure is logged, never raised (the next sweep tries
    again). Returns the names deleted."""
    try:
        return remove(root, anchor, abandoned(root, partial_after_s=partial_after_s, quiet=quiet, keep=keep,
                                              below=below), command=command, partial_after_s=partial_after_s)
    except CkptError as e:  # a prune holding the lock, storage trouble: left for the next sweep
        log.info("%s: abandoned partial checkpoints under %s not removed this time: %s", command, root.url, e)
        return []
