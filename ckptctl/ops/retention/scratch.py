"""Prune's rule for the scratch that killed runs leave under a root: the staging copies of
re-sharding restores, and the temporaries of ckptctl's own atomic writes.

A ``restore --world-size`` stages its copy in a hidden directory of its own
(``ops.transfer.staging``) and removes it however it ends, short of a kill: a SIGKILLed or
lost restore leaves a whole checkpoint's worth of bytes there that no lister shows. Prune plans
each such directory as a ``staging`` item, by the rule and with the discipline of an abandoned
partial checkpoint directory: left alone until nothing in it (the directory itself included)
was modified for ``partial_after_s``, then deleted as planned (marker first, each file only
while unchanged, after ``execute`` listed it again). A live restore writes into its copy
continuously until it re-shards from it; why that is protection enough is in
``docs/decisions.md`` ("A restore's staging copy: one per run, reclaimed by prune").

Every file ckptctl writes on a filesystem is filled under a hidden temporary name next to the
final one (``.NAME.tmp-PID-HEX``: ``storage.local_io.temporary_name``, matched by
``storage.local_io.TEMPORARY`` and nothing else) and renamed or linked into place. A process
SIGKILLed in between leaves the temporary: at the root (the verification record, the root
lock and its ``.break`` guard, DeepSpeed's ``latest`` or Megatron's tracker that ``repoint``,
``cp`` and ``restore`` write) or inside a checkpoint directory (a ``seal``'s, or a file ``cp``
was copying into a checkpoint another stack commits by a file it already has). Prune plans
each as a ``temporary`` item, one file, by the same idle rule: a live writer's temporary is
modified by every write until its rename. Those inside a committed checkpoint it keeps are
taken too; those inside a partial or deleted checkpoint go with it; those in a broken,
duplicate or unknown entry are left with it (``seal`` or ``cp`` run again removes them there).
Why in ``docs/decisions.md`` ("Temporaries killed writes left, reclaimed by prune").

Only what matches exactly is taken: a directory under a staging name, a regular file under a
temporary's; a link under either name is left alone, never followed, and so is a file of any
other name. Temporaries are looked for on a filesystem only: the S3 backend writes each object
in one PUT or one multipart upload and never makes a temporary name (what a killed upload leaves
is an unfinished upload, ``ops.transfer.uploads``).
"""

from __future__ import annotations

from typing import Iterable

from ckptctl.layouts.base import Layout
from ckptctl.layouts.removal import entry_snapshot
from ckptctl.ops.retention.planned import PlanItem, by_idle_time
from ckptctl.ops.transfer.staging import staging_step
from ckptctl.storage.base import Storage
from ckptctl.storage.local_io import temporary_of

NO_STEP = -1  # the step of a temporary at the root: no checkpoint's


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


def temporaries(root: Storage, owner: Layout, now: float, partial_after_s: float,
                kept: Iterable[PlanItem] = ()) -> list[PlanItem]:
    """The temporaries of killed ckptctl writes at the top of ``root`` (``owner``: the layout
    they are listed under, ckptctl's own) and inside the committed checkpoints of ``kept`` that
    the plan does not delete, each to delete when idle for ``partial_after_s`` at ``now``, else
    to leave alone; the root's first, by name, then by checkpoint. None on object storage."""
    if root.local_path() is None:
        return []
    found: list[PlanItem | None] = [_temporary(root, c.key, NO_STEP, owner, now, partial_after_s)
                                    for c in root.children() if c.kind == "file" and temporary_of(c.key) is not None]
    for entry in kept:
        if entry.kind != "committed" or entry.action == "delete" or entry.owner is None:
            continue
        for key, _size, _mtime, kind in entry.snapshot:
            if kind == "file" and temporary_of(key.rsplit("/", 1)[-1]) is not None:
                found.append(_temporary(root, f"{entry.name}/{key}", entry.step, entry.owner, now, partial_after_s,
                                        numbered_by=entry.numbered_by))
    return [i for i in found if i is not None]


def _temporary(root: Storage, key: str, step: int, owner: Layout, now: float, partial_after_s: float, *,
               numbered_by: str = "step") -> PlanItem | None:
    """The plan item of the temporary ``key``, judged by the idle rule; None when it is no
    longer a regular file (its writer renamed it into place since the listing)."""
    snap = entry_snapshot(root, key)
    if len(snap) != 1 or snap[0][0] != "" or snap[0][3] != "file":
        return None
    found = temporary_of(key.rsplit("/", 1)[-1])
    assert found is not None, "only temporaries' names are passed"
    item = PlanItem(step, key, root.url_of(key), "temporary", size=snap[0][1], snapshot=snap, layout=owner.name,
                    owner=owner, numbered_by=numbered_by)
    by_idle_time(root, item, now, partial_after_s, f"the temporary of a ckptctl write of {found[0]} (pid {found[1]})")
    return item
