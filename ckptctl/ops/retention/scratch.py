"""Prune's rule for the staging copies killed re-sharding restores left under the root.

A ``restore --world-size`` stages its copy in a hidden directory of its own
(``ops.transfer.staging``) and removes it however it ends, short of a kill: a SIGKILLed or
lost restore leaves a whole checkpoint's worth of bytes there that no lister shows. Prune plans
each such directory as a ``staging`` item, by the rule and with the discipline of an abandoned
partial checkpoint directory: left alone until nothing in it (the directory itself included)
was modified for ``partial_after_s``, then deleted as planned (marker first, each file only
while unchanged, after ``execute`` listed it again). A live restore writes into its copy
continuously until it re-shards from it; why that is protection enough is in
``docs/decisions.md`` ("A restore's staging copy: one per run, reclaimed by prune").

Only directories are taken: a link or a file under such a name is no restore's and is left
alone, never followed.
"""

from __future__ import annotations

from ckptctl.layouts.base import Layout
from ckptctl.layouts.removal import entry_snapshot
from ckptctl.ops.retention.planned import PlanItem, by_idle_time
from ckptctl.ops.transfer.staging import staging_step
from ckptctl.storage.base import Storage


def staging_copies(root: Storage, owner: Layout, now: float, partial_after_s: float) -> list[PlanItem]:
    """The restores' staging directories under ``root`` (``owner``: the layout they are copies
    in, whose removal order deletes them), each to delete when idle for ``partial_after_s``
    at ``now``, else to leave alone; by step, then name."""
    found = []
    for child in root.children():
        step = staging_step(child.key)
        if step is None or child.kind != "dir":
            continue
        snap = entry_snapshot(root, child.key)
        item = PlanItem(step, child.key, root.url_of(child.key), "staging", size=sum(s[1] for s in snap if s[3] == "file"),
                        snapshot=snap, layout=owner.name, owner=owner)
        by_idle_time(root, item, now, partial_after_s, "a restore's staging copy")
        found.append(item)
    return sorted(found, key=lambda i: (i.step, i.name))
