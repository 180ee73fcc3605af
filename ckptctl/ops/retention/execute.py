"""Executing a prune plan: re-check each entry and delete it commit file first (ckptctl's
marker; another stack's ``.metadata``, ``trainer_state.json``, ...), so that a prune killed at
any point leaves something that reads as partial, never as committed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptctl.errors import CkptError, RefusedForSafety
from ckptctl.layouts.removal import entry_snapshot, remove_entry
from ckptctl.ops.lock import RootLock
from ckptctl.ops.retention.plan import cached_names
from ckptctl.ops.retention.planned import Action, PlanItem, PrunePlan, raise_if_refused
from ckptctl.ops.verify.cache import fingerprint
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
    for name, item in plan.anchors.items():
        anchor = plan.root.sub(item.name)
        layout = item.owner or plan.managed[name]
        # By what vouched for it when planned: its files (and its layout's identity) as verified.
        if item.fingerprint is None or fingerprint(anchor, layout) != item.fingerprint:
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
                _delete(plan, item)
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
        plan.cache.retain(cached_names(plan) - {o.name for o in outcome.deleted})
        plan.cache.save()
        outcome.notes.extend(n for n in plan.cache.notes if n not in plan.notes)
    return outcome


def _changed_since_plan(plan: PrunePlan, item: PlanItem) -> str | None:
    """Why ``item`` may no longer be deleted, or None when it is exactly as planned."""
    anchor = plan.anchors.get(item.layout)
    if item.kind == "unknown" or (item.kind == "committed" and (anchor is None or item.step >= anchor.step)):
        raise RefusedForSafety(f"plan would delete {item.url}, not older than its layout's anchor; refusing")
    if item.kind == "link":
        info = plan.root.stat(item.name)
        return None if info is not None and info.kind == "link" else "no longer a symlink; left alone"
    if entry_snapshot(plan.root, item.name) != item.snapshot:
        return "changed since the plan (a save may be writing into it); left alone"
    return None


def _delete(plan: PrunePlan, item: PlanItem) -> None:
    """Commit file first (the layout's ``removal_order``), only the files the plan saw, each
    only while unchanged; then the directory, when empty."""
    if item.kind == "link":
        plan.root.delete(item.name)
        return
    layout = plan.layout_of(item)
    assert layout is not None, "the plan deletes only what it manages"
    # The entry's own layout says which file un-commits it: that one goes first.
    changed = remove_entry(plan.root, item.name, item.snapshot, layout.removal_order, layout.commit_files)
    if changed is not None:
        raise _Changed(f"{changed} changed while deleting; the rest (or it) is left in place")


def _left_over(root: Storage, item: PlanItem) -> str | None:
    if item.kind != "link" and root.stat(item.name) is not None:
        return "files that appeared after the plan were left in place"
    return None
