"""Executing a prune plan: re-check each entry and delete it marker first, so that a prune
killed at any point leaves something that reads as partial, never as committed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptctl.errors import CkptError, RefusedForSafety
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.ops.lock import RootLock
from ckptctl.ops.prune_plan import Action, PlanItem, PrunePlan, raise_if_refused, snapshot_of
from ckptctl.ops.verify_cache import fingerprint
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")

Result = Literal["deleted", "kept", "skipped", "failed"]


@dataclass
class ItemOutcome:
    step: int
    name: str
    planned: Action
    result: Result
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "planned": self.planned, "result": self.result, "detail": self.detail}


@dataclass
class PruneOutcome:
    items: list[ItemOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _with(self, result: Result) -> list[ItemOutcome]:
        return [i for i in self.items if i.result == result]

    @property
    def deleted(self) -> list[ItemOutcome]:
        return self._with("deleted")

    @property
    def failed(self) -> list[ItemOutcome]:
        return self._with("failed")

    @property
    def skipped(self) -> list[ItemOutcome]:
        """Planned deletions that were not done because the entry changed."""
        return [i for i in self.items if i.planned == "delete" and i.result == "skipped"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "deleted": [i.name for i in self.deleted],
            "failed": [i.to_dict() for i in self.failed],
            "skipped": [i.to_dict() for i in self.skipped],
            "items": [i.to_dict() for i in self.items],
            "notes": list(self.notes),
        }



class _Changed(Exception):
    """An entry differs from the plan; stop deleting it."""


def execute(plan: PrunePlan, *, lock: RootLock | None = None) -> PruneOutcome:
    """Carry out ``plan``. Takes the root's lock unless ``lock`` (held by the caller) is given.

    Raises ``NoValidCheckpoint`` if the plan has no anchor and ``RefusedForSafety`` if the anchor
    changed since it was verified; in both cases nothing is deleted.
    """
    raise_if_refused(plan)
    if lock is None:
        with RootLock(plan.root, command="prune") as own:
            outcome = _execute(plan, own)
            outcome.notes[:0] = own.notes
            return outcome
    return _execute(plan, lock)


def _execute(plan: PrunePlan, lock: RootLock) -> PruneOutcome:
    assert plan.anchor is not None
    anchor = plan.root.sub(plan.anchor.name)
    if fingerprint(anchor) != plan.anchor_fingerprint:
        raise RefusedForSafety(
            f"{anchor.url} changed after it was verified; nothing was deleted",
            hint="run prune again: it verifies the checkpoints afresh",
        )
    outcome = PruneOutcome()
    for item in plan.items:
        if item.action != "delete":
            outcome.items.append(ItemOutcome(item.step, item.name, item.action, "kept" if item.action == "keep" else "skipped"))
            continue
        lock.refresh()
        try:
            why = _changed_since_plan(plan, item)
            if why is None:
                _delete(plan.root, item)
                outcome.items.append(ItemOutcome(item.step, item.name, "delete", "deleted", _left_over(plan.root, item)))
            else:
                outcome.items.append(ItemOutcome(item.step, item.name, "delete", "skipped", why))
        except _Changed as e:
            outcome.items.append(ItemOutcome(item.step, item.name, "delete", "skipped", str(e)))
        except RefusedForSafety:
            raise
        except CkptError as e:  # storage trouble with this entry: report it, go on with the rest
            outcome.items.append(ItemOutcome(item.step, item.name, "delete", "failed", str(e)))
            log.warning("prune: could not delete %s: %s", item.url, e)
    if plan.cache is not None:
        plan.cache.retain({i.name for i in plan.items if i.kind in ("committed", "broken")} - {o.name for o in outcome.deleted})
        plan.cache.save()
        outcome.notes.extend(n for n in plan.cache.notes if n not in plan.notes)
    return outcome


def _changed_since_plan(plan: PrunePlan, item: PlanItem) -> str | None:
    """Why ``item`` may no longer be deleted, or None when it is exactly as planned."""
    assert plan.anchor is not None
    if item.kind == "committed" and item.step >= plan.anchor.step:
        raise RefusedForSafety(f"plan would delete {item.url}, not older than the anchor; refusing")
    if item.kind == "link":
        info = plan.root.stat(item.name)
        return None if info is not None and info.kind == "link" else "no longer a symlink; left alone"
    if snapshot_of(plan.root.sub(item.name)) != item.snapshot:
        return "changed since the plan (a save may be writing into it); left alone"
    return None


def _delete(root: Storage, item: PlanItem) -> None:
    """Marker first, then manifest, then the rest, then the empty directory."""
    if item.kind == "link":
        root.delete(item.name)
        return
    ckpt = root.sub(item.name)
    first = {MARKER: 0, MANIFEST: 1}
    for key, size, mtime, _kind in sorted(item.snapshot, key=lambda s: (first.get(s[0], 2), s[0])):
        now = ckpt.stat(key)
        if now is None:
            continue  # already gone (an earlier, interrupted prune)
        if (now.size, now.mtime) != (size, mtime):
            raise _Changed(f"{ckpt.url_of(key)} changed while deleting; the rest is left in place")
        ckpt.delete(key)
    root.remove_dir(item.name)


def _left_over(root: Storage, item: PlanItem) -> str | None:
    if item.kind != "link" and root.stat(item.name) is not None:
        return "files that appeared after the plan were left in place"
    return None
