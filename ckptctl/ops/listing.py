"""``ls``: every checkpoint under a root with its step, status, size and age.

The catalog (``ckptctl.layouts.catalog``) decides what is a checkpoint and its status from
its layout's commit rule only (cheap): ``committed``, ``partial`` (not committed: being
written, or abandoned), ``corrupt`` (claims to be committed but is not self-consistent),
``link`` (a symlink, which ckptctl never follows) or ``unknown`` (named like a checkpoint, but
no layout recognises its files; never deleted). ``verify`` finds the rest. This module adds
what ``ls`` prints beside it: the layout (FORMAT: ckptctl, dcp, hf-trainer, megatron,
deepspeed, lightning), size, age, and whether a committed checkpoint is resumable or a
model-only export (its layout's ``kind_of_checkpoint``: names and headers, no tensor data).

It also says what a root that holds no checkpoint is instead (``wrong_level``): one checkpoint
(``ls`` named a checkpoint, not its root), or the parent of directories that hold checkpoints
(torchtitan's dump folder, whose checkpoints are in ``checkpoint/``), so that ``ls`` and
``restore`` point at the right level instead of answering "0 checkpoints".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ckptctl.errors import CkptError, NoValidCheckpoint, UsageError
from ckptctl.layouts import catalog
from ckptctl.layouts.aliases import Alias, aliases
from ckptctl.layouts.base import Checkpoint, kind_of_checkpoint, numbered_by
from ckptctl.layouts.lookups import each
from ckptctl.layouts.native_read import total_size
from ckptctl.storage.base import Storage

# How many subdirectories of a root without checkpoints are looked into for some: enough for a
# run's output folder (checkpoint/, tb/, logs/), bounded for a bucket of thousands (a LIST each).
SUBDIRS_LOOKED_INTO = 32


@dataclass(frozen=True)
class Listed:
    step: int
    name: str
    url: str
    status: str
    size: int
    created: float  # manifest time when committed, else newest modification inside
    age_s: float
    reason: str | None = None  # why it is not committed: the layout's completeness rule
    layout: str = "ckptctl"  # the FORMAT column: which layout's checkpoint it is
    content: str | None = None  # committed: "resumable" or "export" (model only); else None
    content_reason: str | None = None  # what its layout saw
    numbered_by: str = "step"  # what STEP counts: "step", or accelerate's "save index" / "epoch"

    def to_dict(self) -> dict:
        return asdict(self)


def list_checkpoints(root: Storage, *, now: float | None = None) -> list[Listed]:
    """Every checkpoint under ``root``, oldest first, with its size and age (several looked at
    at once: ``layouts.lookups``)."""
    now = time.time() if now is None else now
    return each(lambda e: _listed(root, e, now), catalog.list_checkpoints(root))


def _listed(root: Storage, e: Checkpoint, now: float) -> Listed:
    counts = "step" if e.owner is None else numbered_by(e.owner, e.name)
    if e.storage is None:  # a link: nothing behind it is looked at
        return Listed(e.step, e.name, e.url, e.status, 0, 0.0, 0.0, e.reason, e.layout, numbered_by=counts)
    info = root.stat(e.name)
    # A checkpoint that is one file (Lightning's *.ckpt): its own size and time.
    size, newest = (info.size, info.mtime) if info is not None and info.kind == "file" else total_size(e.storage)
    # A manifest's time, else a seal's commit time (not its own file's), else the newest inside.
    created = catalog.commit_time(e, newest)
    if not created and info is not None and info.mtime:
        created = info.mtime  # nothing inside (an empty partial): its directory's time, never the epoch
    content = reason = None
    if e.status == "committed" and e.owner is not None:
        kind = kind_of_checkpoint(e.owner, e.storage, e.manifest)
        content, reason = kind.kind, kind.reason
    return Listed(e.step, e.name, e.url, e.status, size, created, max(0.0, now - created), e.reason, e.layout,
                  content, reason, counts)


def aliases_under(root: Storage, rows: list[Listed]) -> list[Alias]:
    """What the layouts of ``rows`` keep under ``root`` beside their checkpoints, standing for
    one of them (``layouts.aliases``: Lightning's ``last.ckpt``)."""
    out: list[Alias] = []
    for name in dict.fromkeys(r.layout for r in rows):
        layout = catalog.layout_called(name)
        if layout is not None:
            out.extend(aliases(layout.for_root(root)))
    return out


@dataclass(frozen=True)
class WrongLevel:
    """What a root that lists no checkpoint is instead: ``checkpoint`` (it is one: ckptctl's,
    or another tool's layout or format, named in ``what``), or ``parent`` (``below`` names
    its subdirectories that hold checkpoints, with how many)."""

    kind: str  # "checkpoint" or "parent"
    what: str = ""
    below: tuple[tuple[str, int], ...] = ()


def wrong_level_error(root: Storage, path: str, command: str) -> UsageError | None:
    """For a root-level verb given ``path`` (``root``), which lists no checkpoint: the usage
    error that says it is one checkpoint, or the parent of a root, and names the path to give
    instead in ``command`` (a format string taking that path: "ckptctl latest {}"), as ``ls``'s
    hint does; None when it is neither (an empty root, a fresh run)."""
    wrong = wrong_level(root)
    if wrong is None:
        return None
    if wrong.kind == "checkpoint":
        return UsageError(f"{path} is {wrong.what}, not a root of checkpoints",
                          hint=f"give the directory that holds it: `{command.format(parent_of(path))}`")
    return UsageError(below_text(path, wrong.below), hint=f"`{command.format(sub_path(path, wrong.below[0][0]))}`")


def checkpoint_kind(root: Storage) -> str | None:
    """What one checkpoint ``root`` itself is ("a ckptctl checkpoint", "a dcp checkpoint",
    "a lightning checkpoint file"), or None when it is none: the classifier's answer
    (``layouts.classify``), so ``ls`` and every other verb agree on what a path is."""
    from ckptctl.layouts.classify import classify  # imported when needed: only for an empty listing

    try:
        return classify(root.url).description
    except CkptError:  # a path that cannot be read or judged: no hint, and the listing stands
        return None


def holders_below(root: Storage, *, limit: int = SUBDIRS_LOOKED_INTO) -> list[tuple[str, int]]:
    """Subdirectories of ``root`` that hold checkpoints, with how many each (the first
    ``limit`` subdirectories, by name, are looked into; links are never followed)."""
    found = []
    dirs = sorted(c.key for c in root.children() if c.kind == "dir")
    for name in dirs[:limit]:
        try:
            n = len(catalog.list_checkpoints(root.sub(name)))
        except CkptError:  # unreadable (permissions): only a hint is lost, never the listing
            continue
        if n:
            found.append((name, n))
    return found


def wrong_level(root: Storage) -> WrongLevel | None:
    """For a root that lists no checkpoint: is it one checkpoint, or the parent of roots?
    None when neither (an empty root, a fresh run)."""
    what = checkpoint_kind(root)
    if what is not None:
        return WrongLevel("checkpoint", what)
    below = holders_below(root)
    return WrongLevel("parent", below=tuple(below)) if below else None


def parent_of(url: str) -> str:
    """The directory or prefix that holds ``url`` (a path as given, or a URL)."""
    stripped = url.rstrip("/")
    head, sep, _tail = stripped.rpartition("/")
    if not sep or head.endswith(":/"):  # a bare relative name, or s3://bucket
        return "." if not sep else stripped
    return head or "/"


def below_text(path: str, below: tuple[tuple[str, int], ...]) -> str:
    """``"checkpoint/ holds 3 checkpoints"``, for up to three subdirectories."""
    parts = [f"{name}/ holds {n} checkpoint{'' if n == 1 else 's'}" for name, n in below[:3]]
    more = f" (and {len(below) - 3} more subdirectories)" if len(below) > 3 else ""
    return f"no checkpoint directly in {path}, but " + ", ".join(parts) + more


def sub_path(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def nothing_to_restore(root: Storage) -> CkptError:
    """The error for ``restore`` when ``root`` gave it no checkpoint to copy, built from the
    listing ``ls`` shows, so that the two never disagree: Lightning's one-file checkpoints
    (which restore does not copy: a UsageError saying so), checkpoints none of which is
    committed, one checkpoint or a parent of roots (the wrong level), or truly nothing."""
    rows = catalog.list_checkpoints(root)
    files = [(e, e.owner) for e in rows if e.status == "committed" and e.owner is not None
             and e.owner.files_are_checkpoints]
    if files:
        n, layout = len(files), files[-1][1]
        return UsageError(
            f"{root.url} holds {n} {layout.title} checkpoint{'' if n == 1 else 's'} "
            "(one file each); restore copies checkpoint directories only, not one-file checkpoints",
            hint=f"copy the newest good one as a file: ckptctl cp \"$(ckptctl latest SRC --format {layout.name})\" DST")
    if rows:
        counts: dict[str, int] = {}
        for e in rows:
            counts[e.status] = counts.get(e.status, 0) + 1
        held = ", ".join(f"{n} {status}" for status, n in counts.items())
        return NoValidCheckpoint(f"{root.url}: no committed checkpoint to restore ({held})",
                                 hint=f"`ckptctl ls {root.url}` shows why each is not committed")
    wrong = wrong_level(root)
    if wrong is not None and wrong.kind == "checkpoint":
        return NoValidCheckpoint(f"{root.url} is {wrong.what}, not committed by its layout's rule",
                                 hint=f"`ckptctl verify {root.url}` says what is missing")
    if wrong is not None:
        sub = sub_path(root.url, wrong.below[0][0])
        return NoValidCheckpoint(f"{below_text(root.url, wrong.below)}",
                                 hint=f"restore from the subdirectory: `ckptctl restore {sub} DST`")
    return NoValidCheckpoint(f"{root.url}: no checkpoint of any known layout",
                             hint="check SRC; nothing has been saved there")
