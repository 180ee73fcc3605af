"""Planning a prune: survey every checkpoint entry under the root and decide what to keep and delete.

``plan()`` reads only (apart from the verification record) and never deletes; see
``ckptctl.ops.retention.prune`` for the safety rules it applies and ``ops.retention.execute`` for carrying a
plan out.

A root may hold checkpoints of several layouts (ckptctl's own, torchtitan/DCP, the Hugging
Face Trainer, Megatron-LM, DeepSpeed, ...: ``layouts.catalog``). Each layout's checkpoints are
planned on their own: their own anchor (the newest resumable one that passes full
verification by that layout's rules: the one verify engine at ``ANCHOR_LEVEL``, so ``verify``
at that level and ``prune`` never disagree about a checkpoint), the policies counted within the
layout, what its pointers and best checkpoints name protected. Only a layout's *own* incomplete checkpoints are subject to
``partial_after_s``, and so are the staging copies and temporaries killed runs left
(``ops.retention.scratch``); a directory no layout claims (``unknown``) is never deleted.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format.seal import SEAL
from ckptctl.layouts.base import Checkpoint, Layout, kind_of_checkpoint, numbered_by
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, LAYOUTS, commit_time, list_checkpoints, recorded_metrics
from ckptctl.layouts.checked import Level
from ckptctl.layouts.lookups import each
from ckptctl.layouts.protection import protected
from ckptctl.layouts.removal import entry_snapshot
from ckptctl.ops.retention.planned import PlanItem, PrunePlan, by_idle_time
from ckptctl.ops.retention.policies import Candidate, KeepSteps, RetentionPolicy
from ckptctl.ops.retention.scratch import staging_copies, temporaries
from ckptctl.ops.seal.sealing import write_seal
from ckptctl.ops.verify.cache import Fingerprint, VerifyCache, fingerprint, verify_cached
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

DEFAULT_PARTIAL_AFTER_S = 6 * 3600.0
ANCHOR_LEVEL: Level = "load"


def plan(
    root: Storage,
    policy: RetentionPolicy,
    *,
    partial_after_s: float = DEFAULT_PARTIAL_AFTER_S,
    delete_broken: bool = False,
    reverify: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
    heartbeat: Callable[[], None] | None = None,
    layouts: Sequence[Layout] = LAYOUTS,
    record: bool = True,
    seal: bool = False,
) -> PrunePlan:
    """Decide what to keep and delete under ``root``. Reads only, apart from the verification
    record (an optimisation that is always safe to write). Never raises for a checkpoint
    problem: a plan with nothing verified has ``refused`` set and deletes nothing.

    ``heartbeat`` is called between verifications (a lock holder refreshes its lock there).
    ``layouts`` are the layouts whose checkpoints may be deleted (``Checkpointer`` retention
    passes ckptctl's own only); other layouts' entries are listed and left alone. With
    ``seal`` another stack's anchor that was test-loaded here and has no seal yet is sealed
    (``ops.seal.sealing``; not on a dry run); a sealed anchor is trusted when every byte still matches
    its seal, without test-loading it again.
    """
    p = PrunePlan(root, policy, partial_after_s, delete_broken, reverify, time.time() if now is None else now,
                  seal=seal, record=record, managed={layout.name: layout for layout in layouts})
    p.cache = VerifyCache.load(root, read_only=not record)  # record=False: a dry run writes nothing
    entries = list_checkpoints(root)
    p.items = each(lambda e: survey(root, e, p.now, partial_after_s), entries)  # reads only: several at once
    _refuse_step_rules(p)
    _attach_metrics(root, entries, p.items)
    for item in p.items:
        # A symlink under another stack's name is that stack's too (DeepSpeed's `latest` may
        # name it): library retention leaves it alone like the stack's directories.
        if p.layout_of(item) is None and item.kind != "unknown":
            item.kind, item.action = "unknown", "skip"
            item.reason = f"a {item.layout} checkpoint; this prune manages {', '.join(sorted(p.managed))} only"
    _mark_duplicates(p.items)
    members: dict[str, list[PlanItem]] = {}  # by layout, in plan order
    for item in p.items:
        members.setdefault(item.layout, []).append(item)
    groups = sorted({i.layout for i in p.items if i.kind in ("committed", "broken", "partial")})
    for name in groups:
        _choose_anchor(p, name, members[name], progress, heartbeat)
    _pick_primary_anchor(p, groups, members)
    for name in groups:
        _apply_policy(p, name, members[name])
    committed = [Candidate(i.step, 0.0) for i in p.items if i.kind == "committed"]
    for pol in p.policy.policies:
        if isinstance(pol, KeepSteps):
            for step in sorted(pol.missing(committed)):
                p.notes.append(f"--keep {step}: no committed checkpoint has that step")
    for item in p.items:
        if item.kind == "broken":
            _decide_broken(p, item)
    for item in p.deletions:
        if item.kind != "link" and p.anchors.get(item.layout) is None:
            item.action, item.reason = "skip", f"{item.reason}; not deleted: no {item.layout} checkpoint verifies"
    _protect(p, root)
    own = p.managed.get(CHECKPOINTER_LAYOUTS[0].name)  # what a restore stages in, ckptctl's temporaries listed under
    if own is not None:
        p.items += staging_copies(root, own, p.now, partial_after_s) + temporaries(root, own, p.now, partial_after_s, p.items)
    if p.refused is not None:
        for item in p.deletions:
            item.action, item.reason = "skip", f"{item.reason}; not deleted: no checkpoint verifies"
    p.cache.retain(cached_names(p))
    p.cache.save()
    p.notes.extend(p.cache.notes)
    return p


def _refuse_step_rules(p: PrunePlan) -> None:
    """A rule that reads checkpoint numbers as training steps (``--keep-every``, ``--keep``) on
    a root whose layout numbers them by something else (accelerate's ``checkpoint_N``: its save
    index) would keep the wrong checkpoints: a UsageError naming the rule, before any
    checkpoint is read or deleted."""
    rules = [pol.step_option for pol in p.policy.policies if pol.step_option is not None]
    if not rules:
        return
    for item in p.items:
        own = p.layout_of(item)
        if own is None or (counts := numbered_by(own, item.name)) == "step":
            continue
        raise UsageError(f"{rules[0]} reads checkpoint numbers as training steps, but {own.title} numbers "
                         f"{item.name} by {counts} under {p.root.url}",
                         hint="keep by count or age instead (--keep-last N, --keep-within DURATION), or have the job "
                              f"name its checkpoints by training step (ckptctl-layouts(7), {own.name}, says how)")


def cached_names(p: PrunePlan) -> set[str]:
    """The checkpoints whose verification the record keeps (those whose layout names an
    identity: the record holds no other)."""
    return {i.name for i in p.items if i.kind in ("committed", "broken") and p.layout_of(i) is not None}


def survey(root: Storage, entry: Checkpoint, now: float, partial_after_s: float) -> PlanItem:
    """Classify one catalog entry from its status and a snapshot of its files (no data read)."""
    step, name, url, ckpt = entry.step, entry.name, entry.url, entry.storage
    if entry.status == "unknown" or entry.owner is None:
        return PlanItem(step, name, url, "unknown", "skip", entry.reason or "no layout recognises it", layout=entry.layout)
    counts = numbered_by(entry.owner, name)
    if ckpt is None:  # a link
        return PlanItem(step, name, url, "link", "delete",
                        "symlink: the link is removed, never followed; its target is not touched", layout=entry.layout,
                        owner=entry.owner, numbered_by=counts)
    snap = entry_snapshot(root, name)
    item = PlanItem(step, name, url, "partial", size=sum(s[1] for s in snap if s[3] == "file"), snapshot=snap,
                    layout=entry.layout, owner=entry.owner, numbered_by=counts)
    layout = entry.owner
    # From the snapshot execute deletes by: a marker newer than the catalog's look is a commit.
    marker = layout.commit_marker
    if (marker is not None and not any(key == marker for key, *_ in snap)) or (marker is None and entry.status == "partial"):
        why = "no marker" if marker is not None else f"incomplete {entry.layout} checkpoint ({entry.reason})"
        by_idle_time(root, item, now, partial_after_s, why)
        return item
    if entry.status == "partial":
        # Committed between the catalog's look and the snapshot: judged on the next run.
        item.reason = "committed while this plan was made; left alone until the next prune"
        return item
    if entry.status != "committed":
        item.kind, item.reason = "broken", entry.reason or entry.status
        return item
    item.kind = "committed"
    item.created = commit_time(entry, max((s[2] for s in snap), default=0.0))
    return item


def _attach_metrics(root: Storage, entries: list[Checkpoint], items: list[PlanItem]) -> None:
    """What ``KeepBest`` ranks by (``catalog.recorded_metrics``)."""
    metrics = recorded_metrics(root, entries)
    for item in items:
        if item.kind == "committed":
            item.metrics = metrics.get(item.name, {})


def _mark_duplicates(items: list[PlanItem]) -> None:
    """Two directories of one layout for one step (``step-9`` and ``step-0000000009``): which
    one a reader picks is not well defined, so neither is ever deleted or trusted as the anchor."""
    dirs: dict[tuple[str, int], list[PlanItem]] = {}
    for i in items:
        if i.kind not in ("link", "unknown"):
            dirs.setdefault((i.layout, i.step), []).append(i)
    for same in dirs.values():
        if len(same) > 1:
            names = ", ".join(i.name for i in same)
            for i in same:
                i.kind, i.action = "duplicate", "skip"
                i.reason = f"{len(same)} directories claim step {i.step} ({names}); left alone, rename one"


def _summary(report: VerifyReport, cached: bool) -> dict[str, Any]:
    return {
        "ok": report.ok, "cached": cached, "level": report.level, "bytes_read": report.bytes_read,
        "seconds": round(report.seconds, 3), "problems": [str(pr) for pr in report.problems], "note": report.note,
        "seal_hint": report.seal_hint,  # its format records no checksums: how to give it some
    }


def _choose_anchor(p: PrunePlan, layout: str, members: list[PlanItem], progress: Progress | None,
                   heartbeat: Callable[[], None] | None) -> None:
    """The newest resumable checkpoint of ``layout`` (of ``members``) that passes full verification
    by its own rules: an export (model only; kept by policy) is never what a deletion relies on."""
    committed = [i for i in members if i.kind == "committed"]
    for item in reversed(committed):
        if heartbeat:
            heartbeat()
        ckpt = p.root.sub(item.name)
        told = item.owner
        assert told is not None, "a committed entry has its layout"
        if not (kind := kind_of_checkpoint(told, ckpt)).resumable:
            p.notes.append(f"{item.name}: not the anchor: an export ({kind.reason})")
            continue
        # ``verify`` at ANCHOR_LEVEL, or its recorded success for this very fingerprint.
        report, cached, fp = verify_cached(ckpt, item.name, p.cache, layout=told, level=ANCHOR_LEVEL,
                                           reverify=p.reverify, progress=progress)
        if fp is not None and report.ok and p.seal and told.seal_note is None and not cached:
            fp = _seal_anchor(p, item, ckpt, told, report, fp)
        item.verification = _summary(report, cached)
        if report.ok and fp is not None:
            p.anchors[layout] = item
            item.fingerprint = fp  # execute checks it is unchanged before deleting anything
            return
        item.kind = "broken"
        item.reason = ("changed while it was being verified" if report.ok
                       else f"fails full verification: {report.problems[0]}"
                       + (f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""))


def _seal_anchor(p: PrunePlan, item: PlanItem, ckpt: Storage, layout: Layout, report: VerifyReport,
                 fp: Fingerprint) -> Fingerprint:
    """``prune --seal``: seal the anchor just test-loaded (unless sealed already), and take the
    seal into the anchor's snapshot and fingerprint so that execute still finds it as verified.
    Returns the fingerprint that vouches for it now."""
    if any(key == SEAL for key, *_ in item.snapshot) or report.level != "load":
        return fp
    if not p.record:
        p.notes.append(f"{item.name}: would be sealed (--seal; not on a dry run)")
        return fp
    try:
        done = write_seal(ckpt, layout, report, expected=item.snapshot)
    except InvalidCheckpoint as e:
        p.notes.append(f"{item.name}: not sealed: {e}")
        return fp
    after = entry_snapshot(p.root, item.name)
    if tuple(s for s in after if s[0] != SEAL) == item.snapshot:
        item.snapshot = after
        fp = fingerprint(ckpt, layout)
    p.notes.append(f"{item.name}: {done.status} ({done.files} files, test-loaded by this prune)")
    return fp


def _pick_primary_anchor(p: PrunePlan, groups: list[str], members: dict[str, list[PlanItem]]) -> None:
    """``anchor`` is the anchor of the first managed layout, in the catalog's order (ckptctl's
    own first), that has one; ``refused`` is set when no layout has one (then nothing at all
    is deleted)."""
    if p.anchors:
        p.anchor = next(p.anchors[name] for name in p.managed if name in p.anchors)
        for name in groups:
            if name not in p.anchors and any(i.kind in ("committed", "broken") for i in members[name]):
                p.notes.append(f"no {name} checkpoint passes full verification: none of them is deleted")
        return
    marked = [i for i in p.items if i.kind == "broken"]
    if marked:
        p.refused = (f"{p.root.url}: none of {len(marked)} committed checkpoint(s) passes full verification; "
                     "nothing is deleted")
    else:
        p.refused = f"{p.root.url}: no committed checkpoint; nothing is deleted"


def _apply_policy(p: PrunePlan, layout: str, members: list[PlanItem]) -> None:
    """Committed checkpoints of ``layout`` (``members``) up to its anchor go to the policies; the
    anchor is always kept."""
    own = p.anchors.get(layout)
    cands = [i for i in members if i.kind == "committed" and (own is None or i.step <= own.step)]
    by_step = {i.step: i for i in cands}
    anchor = own.step if own is not None else None
    decisions = p.policy.decide([Candidate(i.step, float(i.created or 0.0), i.metrics) for i in cands], anchor, now=p.now)
    for step, d in decisions.items():
        item = by_step[step]
        if d.implausible:  # a wrong clock on the saving host: flagged, never a reason to delete
            p.notes.append(f"{item.name}: implausible {d.implausible}; time-based rules ignore it")
        if d.keep:
            item.action, item.reason = "keep", "; ".join(d.reasons)
        else:
            item.action = "delete"
            item.reason = (f"older than the anchor ({own.label}) and kept by no policy ({p.policy.describe()})"
                           if own is not None else f"kept by no policy ({p.policy.describe()})")


def _decide_broken(p: PrunePlan, item: PlanItem) -> None:
    own = p.anchors.get(item.layout)
    newer = own is None or item.step > own.step
    where = "newer than the anchor" if newer else "older than the anchor"
    if p.delete_broken and own is not None:
        item.action, item.reason = "delete", f"broken ({where}), --delete-broken: {item.reason}"
    else:
        item.action = "skip"
        item.reason = f"broken ({where}), reported, not deleted (--delete-broken removes it): {item.reason}"


def _protect(p: PrunePlan, root: Storage) -> None:
    """What other stacks' pointers name (DeepSpeed ``latest``, Megatron's tracker), Trainer's
    ``best_model_checkpoint`` and every Lightning ``ModelCheckpoint``'s best are kept whatever
    the policies say, as those stacks do; a pointer that cannot be read keeps all it might name,
    and a symlink it names is kept (``layouts.protection``). Only the layouts this prune
    manages are asked: the others' entries are left alone anyway."""
    entries = [(i.layout, i.name, i.kind) for i in p.items if p.layout_of(i) is not None]
    for target, why in protected(root, entries).items():
        for item in p.items:
            if item.name == target and p.layout_of(item) is not None:
                if item.action == "delete":
                    item.action, item.reason = "keep", f"protected: {why}"
                elif item.action == "keep":
                    item.reason = f"{item.reason}; protected: {why}"
