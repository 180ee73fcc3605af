"""The pointers other stacks resume from, checked and moved back: ``verify ROOT --latest`` and
``ckptctl repoint ROOT``.

DeepSpeed's ``load_checkpoint(ROOT)`` loads the tag ``ROOT/latest`` names, Megatron's
``--load ROOT`` the iteration in ``latest_checkpointed_iteration.txt``. Both are written before
(DeepSpeed) or after (Megatron) the files, by rank 0 alone, and neither is checked on load: a
pointer that names a truncated checkpoint resumes it. ``check_pointers`` verifies what each
pointer names and, when it does not verify, finds the newest older checkpoint of that stack
that does. ``repoint`` rewrites the pointer to that one, atomically (temp + fsync + rename +
directory fsync), under the root's lock, only backwards, and by compare-and-swap
(``Storage.compare_and_swap``): only while the pointer still holds what was judged, checked
after the new pointer is durable and re-checked after the rename, so a training job that
rewrote it meanwhile, even in place as DeepSpeed and Megatron do, wins.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Sequence

from ckptctl.errors import RefusedForSafety, UsageError
from ckptctl.storage.stored_file import open_file
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import FORMATS, layout_named, layouts_named, list_checkpoints, newest_marked
from ckptctl.layouts.checked import Level
from ckptctl.ops.lock import DEFAULT_STALE_AFTER_S, RootLock
from ckptctl.ops.verify.engine import verify_entry
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

MAX_POINTER_BYTES = 256  # a tag or an iteration; anything longer is not a pointer we rewrite


@dataclass
class PointerCheck:
    """What one stack's pointer names and whether that verifies; when it does not, the newest
    older checkpoint of the stack that does (``good``), or None when there is none."""

    layout: str
    pointer: str  # the pointer file under the root ("latest", "latest_checkpointed_iteration.txt")
    value: str  # what it holds, as read (stripped)
    target: str | None  # the checkpoint it names (a directory name), None when unreadable
    step: int | None
    ok: bool
    problem: str | None = None  # why the target does not verify
    report: VerifyReport | None = None  # the target's verification (None: not a checkpoint at all)
    good: str | None = None  # name of the newest older checkpoint that verifies
    good_step: int | None = None
    good_url: str | None = None
    root_url: str = ""

    def repoint_command(self) -> str:
        return f"ckptctl repoint {shlex.quote(self.root_url)} --format {self.layout}"

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "pointer": self.pointer, "value": self.value, "target": self.target,
                "step": self.step, "ok": self.ok, "problem": self.problem,
                "verifies": None if self.good is None else {"name": self.good, "step": self.good_step,
                                                            "url": self.good_url},
                "repoint": None if self.ok or self.good is None else self.repoint_command()}


def _pointer_layouts(root: Storage, formats: Sequence[str] | None) -> list[Layout]:
    """The stack layouts (of ``formats``) whose pointer file exists under ``root``, bound to it."""
    try:
        layouts = layouts_named(formats)
    except ValueError as e:
        raise UsageError(f"--format: {e}", hint=f"use one of {', '.join(FORMATS)}") from None
    out = []
    for layout in layouts:
        if layout.pointer_file is None:  # no root-level pointer (ckptctl's own, the Trainer, DCP...)
            continue
        if root.stat(layout.pointer_file) is None:
            continue
        out.append(layout_named(layout.name, root))
    return out


def _raw_pointer(root: Storage, key: str) -> bytes | None:
    f = open_file(root, key)  # no link followed, no FIFO waited on
    if f is None:
        return None
    with f:
        return f.read(MAX_POINTER_BYTES + 1)


def check_pointer(root: Storage, layout: Layout, level: Level = "checksums", *,
                  progress: Progress | None = None, known: dict[str, VerifyReport] | None = None,
                  find_good: bool = True) -> PointerCheck:
    """Verify what ``layout``'s pointer (bound to ``root``) names; ``known`` holds reports
    already made in this run (by URL), so nothing is verified twice."""
    known = {} if known is None else known
    assert layout.pointer_file is not None
    raw = _raw_pointer(root, layout.pointer_file) or b""
    value = raw[:MAX_POINTER_BYTES].decode("utf-8", "replace").strip()
    named = layout.pointer_target()
    check = PointerCheck(layout.name, layout.pointer_file, value, None, None, False, root_url=root.url)
    if named is None:
        check.problem = f"{layout.pointer_file} holds {value[:40]!r}: which checkpoint it names is unknown"
        return check
    _key, check.target, check.step = named
    entry = next((e for e in list_checkpoints(root, layouts=layouts_named([layout.name])) if e.name == check.target),
                 None)
    if entry is None or entry.status == "unknown":  # absent, or not its files (a FIFO under its name)
        check.problem = f"{layout.pointer_file} names {check.target}, which is not a {layout.title} checkpoint here"
    elif entry.storage is None:
        check.problem = f"{layout.pointer_file} names {check.target}, a symlink (never followed)"
    elif entry.status == "partial":
        check.problem = f"{layout.pointer_file} names {check.target}: {entry.reason or 'incomplete'}"
    else:
        report = known.get(entry.url) or verify_entry(entry, level, progress)
        known[entry.url] = report
        check.report, check.ok = report, report.ok
        if not report.ok:
            first = report.problems[0] if report.problems else "did not verify"
            check.problem = f"{layout.pointer_file} names {check.target}, which does not verify: {first}"
    if not check.ok and find_good and check.step is not None:
        for e in newest_marked(root, layouts=layouts_named([layout.name])):
            if e.step >= check.step or e.storage is None:
                continue  # only backwards: never forward to a save the pointer did not commit
            rep = known.get(e.url) or verify_entry(e, level, progress)
            known[e.url] = rep
            if rep.ok:
                check.good, check.good_step, check.good_url = e.name, e.step, e.url
                break
    return check


def check_pointers(root: Storage, level: Level = "checksums", *, formats: Sequence[str] | None = None,
                   progress: Progress | None = None, known: dict[str, VerifyReport] | None = None) -> list[PointerCheck]:
    """``check_pointer`` for every stack pointer present under ``root`` (of ``formats``)."""
    known = {} if known is None else known
    return [check_pointer(root, layout, level, progress=progress, known=known)
            for layout in _pointer_layouts(root, formats)]


@dataclass
class RepointResult:
    """What ``repoint`` found and did: the pointer's old value is kept (``old``)."""

    root: str
    layout: str
    pointer: str
    old: str  # the pointer's content before (stripped)
    old_target: str | None
    new: str | None  # the content written (or that a dry run would write); None: nothing to do
    new_target: str | None
    new_step: int | None
    changed: bool
    dry_run: bool
    message: str
    level: str
    checked: list[VerifyReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "format": self.layout, "pointer": self.pointer, "old": self.old,
                "old_target": self.old_target, "new": self.new, "new_target": self.new_target,
                "new_step": self.new_step, "changed": self.changed, "dry_run": self.dry_run,
                "message": self.message, "level": self.level, "notes": self.notes,
                "checked": [r.to_dict() for r in self.checked]}


def repoint(root: Storage, level: Level = "checksums", *, formats: Sequence[str] | None = None,
            dry_run: bool = False, progress: Progress | None = None, command: str = "repoint",
            lock_stale_after_s: float = DEFAULT_STALE_AFTER_S) -> RepointResult:
    """Move the stack's pointer under ``root`` back to the newest checkpoint that verifies, when
    the one it names does not. A pointer whose target verifies is left alone (``changed`` is
    False). Raises UsageError (no pointer of ``formats``; several stacks' pointers and no
    ``formats`` to pick one), RefusedForSafety (exit 1: the pointer is unreadable, nothing
    older verifies, or the pointer changed while it was judged), LockHeld (exit 3).

    A dry run takes no lock and writes nothing."""
    layouts = _pointer_layouts(root, formats)
    if not layouts:
        which = "/".join(formats) if formats else "DeepSpeed `latest` or Megatron tracker"
        raise UsageError(f"{root.url}: no {which} pointer file here; nothing to repoint",
                         hint="repoint moves DeepSpeed's `latest` or Megatron's latest_checkpointed_iteration.txt; "
                              "give the root that holds it")
    if len(layouts) > 1:
        raise UsageError(f"{root.url} holds the pointers of {', '.join(la.name for la in layouts)}",
                         hint="pick one with --format")
    if dry_run:
        return _repoint(root, layouts[0].name, level, dry_run=True, progress=progress)
    with RootLock(root, command=command, stale_after_s=lock_stale_after_s) as lock:
        result = _repoint(root, layouts[0].name, level, dry_run=False, progress=progress)
        result.notes[:0] = lock.notes
        return result


def _repoint(root: Storage, name: str, level: Level, *, dry_run: bool, progress: Progress | None) -> RepointResult:
    pointer_file = layouts_named([name])[0].pointer_file
    assert pointer_file is not None
    # Read before the layout reads it (under the lock): the swap below writes only if the
    # pointer still holds these bytes, so what was judged is never older than what is replaced.
    before = _raw_pointer(root, pointer_file)
    layout = layout_named(name, root)
    known: dict[str, VerifyReport] = {}
    check = check_pointer(root, layout, level, progress=progress, known=known)
    checked = list(known.values())
    base = dict(root=root.url, layout=name, pointer=layout.pointer_file, old=check.value, old_target=check.target,
                level=level, checked=checked, dry_run=dry_run)
    if check.ok:
        return RepointResult(**base, new=None, new_target=None, new_step=None, changed=False,  # type: ignore[arg-type]
                             message=f"nothing to do: {layout.pointer_file} names {check.target}, which verifies ({level})")
    if check.target is None or check.step is None:
        raise RefusedForSafety(f"{check.problem}; not rewritten (it cannot be told which way is backwards)",
                               hint=f"write the tag or iteration of a checkpoint that verifies into "
                                    f"{layout.pointer_file} by hand, after `ckptctl verify ROOT --all`")
    if check.good is None or check.good_step is None:
        raise RefusedForSafety(f"{check.problem}; and no older {layout.title} checkpoint verifies ({level}): "
                               f"{layout.pointer_file} left as it is",
                               hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
    pointer = layout.pointer_for(check.good, check.good_step)
    assert pointer is not None
    key, content = pointer
    message = f"{layout.pointer_file}: {check.target} -> {check.good} ({check.problem})"
    if not dry_run:
        # Compare-and-swap: written only if the pointer still holds what was judged, checked once
        # the new one is durable, and put back if a save rewrote it in place meanwhile.
        found = root.compare_and_swap(key, before, content)
        if found != before:
            raise RefusedForSafety(
                f"{root.url_of(key)} changed while repoint judged it: it held {_shown(before)}, now {_shown(found)} "
                f"(a save committed meanwhile?); left as it is, not moved to {check.good}",
                hint="run `ckptctl verify ROOT --latest` again")
    return RepointResult(**base, new=content.decode("utf-8"), new_target=check.good,  # type: ignore[arg-type]
                         new_step=check.good_step, changed=not dry_run, message=message)


def _shown(raw: bytes | None) -> str:
    return "nothing" if raw is None else repr(raw[:MAX_POINTER_BYTES].decode("utf-8", "replace").strip())


__all__ = ["PointerCheck", "RepointResult", "check_pointer", "check_pointers", "repoint"]
