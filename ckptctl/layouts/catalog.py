"""The catalog: the one way every root-wide verb and ``load_latest`` list checkpoints.

A root's children are offered to each known layout (``registry.LAYOUTS``: ckptctl's own, then
torchtitan/DCP, the Hugging Face Trainer, Megatron-LM, DeepSpeed, Lightning's ``*.ckpt``
files, accelerate, Composer, NeMo, then any third-party layout installed by entry point), and
``classify`` decides which one owns each (``named_children``, ``owner``, ``rival``): a
directory no layout claims is listed as ``unknown`` and nothing ever deletes it. Each entry
carries its layout, bound to the root (``Checkpoint.owner``), so a verb asks it directly.

- ``list_checkpoints(root)``: everything, oldest first, each with its cheap status (``ls``,
  ``prune``'s survey).
- ``newest_committed(root)``: committed ones, newest first, lazily (``load_latest``, ``interval``).
- ``newest_marked(root)``: those that claim to be committed, newest first, lazily, corrupt
  ones included (``verify --all/--latest``, ``latest``: they report what they skip).

``load_latest``, the tiers, library retention and the interval statistics read what the
``Checkpointer`` saves: they pass ``layouts=CHECKPOINTER_LAYOUTS``. The lazy walks cost one
listing and one commit-marker lookup per directory actually taken, so "the newest that
verifies" under thousands of checkpoints (S3: a HEAD each) stays cheap.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.format.seal import MAX_SEAL_BYTES, SEAL, parse_seal
from ckptctl.layouts.base import UNKNOWN, Checkpoint, Layout
from ckptctl.layouts.classify import Named, marked, named_children, owner, rival
from ckptctl.layouts.lookups import each
from ckptctl.layouts.registry import (  # noqa: F401 (BUILTIN, FORMATS, layouts_named, layout_named: the catalog's vocabulary)
    BUILTIN, CHECKPOINTER_LAYOUTS, FORMATS, LAYOUTS, layout_called, layout_named, layouts_named)
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.known import Remembered


def count_named(root: Storage, *, layouts: Sequence[Layout] = LAYOUTS) -> int:
    """How many children of ``root`` some layout recognises by name: as many as
    ``list_checkpoints`` lists, from one listing, without reading any of them."""
    return len(named_children(root, layouts))


def _unknown(found: Named, ckpt: Storage) -> Checkpoint:
    known, child, step = found
    looked = ", ".join(layout.name for layout in known)
    return Checkpoint(step, child.key, ckpt.url, UNKNOWN, "unknown",
                      f"named like a {looked} checkpoint, but no layout recognises its files as its own; "
                      "never deleted", ckpt)


def _entry(root: Storage, found: Named, own: Layout | None = None, ckpt: Storage | None = None) -> Checkpoint:
    known, child, step = found
    name = child.key
    if child.kind == "link":
        return Checkpoint(step, name, root.url_of(name), known[0].name, "link", "symlink, not followed",
                          owner=known[0])
    ckpt = root.sub(name) if ckpt is None else ckpt
    if own is None:
        own, _ = owner(ckpt, known, child.kind)
        if own is None:
            return _unknown(found, ckpt)
    seen = own.examine(ckpt)
    if seen.status == "partial" and child.kind == "dir":
        other = rival(root, ckpt, own)
        if other is not None:
            return Checkpoint(step, name, ckpt.url, UNKNOWN, "unknown",
                              f"named like a {own.name} checkpoint and not complete by its rule ({seen.reason}), "
                              f"but complete by {other}'s; never deleted", ckpt)
    return Checkpoint(step, name, ckpt.url, own.name, seen.status, seen.reason, ckpt, seen.manifest, own)


def list_checkpoints(root: Storage, *, layouts: Sequence[Layout] = LAYOUTS) -> list[Checkpoint]:
    """Every checkpoint directory (and step-named symlink) under ``root``, oldest first, with
    its status from its layout's commit rule only (no data read). Raises only StorageError.
    The checkpoints are looked at several at once (``layouts.lookups``)."""
    return each(lambda f: _entry(root, f), named_children(root, layouts))


def other_tools_committed(root: Storage) -> list[Checkpoint]:
    """The committed checkpoints under ``root`` the ``Checkpointer`` did not save (never an
    unknown directory or a link), oldest first."""
    theirs = [layout for layout in LAYOUTS if layout not in CHECKPOINTER_LAYOUTS]
    return [e for e in list_checkpoints(root, layouts=theirs) if e.layout != UNKNOWN
            and e.status == "committed" and e.storage is not None]


def newest_marked(root: Storage, *, step: int | None = None, layouts: Sequence[Layout] = LAYOUTS,
                  children: Sequence[ObjectInfo] | None = None) -> Iterator[Checkpoint]:
    """Directories that claim to be committed, newest first, lazily: committed, or corrupt
    (claiming to be committed). With ``step``, only directories of that step. Symlinks are
    never followed; directories no layout claims are never taken. ``children``: the root's
    listing the verb just made (``classify``'s ``Found.children``), not made again."""
    for found in reversed(named_children(root, layouts, children)):
        known, child, found_step = found
        if child.kind == "link" or (step is not None and found_step != step):
            continue
        ckpt = root.sub(child.key)
        if ckpt.local_path() is None:
            # The verb reads the record the commit rule read next (a verify, a copy): on object
            # storage it gets the same bytes without asking again (``storage.known``).
            ckpt = Remembered(ckpt)
        own, by_marker = owner(ckpt, known, child.kind)
        if own is None or not (by_marker or marked(own, ckpt)):
            continue
        entry = _entry(root, found, own, ckpt)
        if entry.status in ("committed", "corrupt"):  # not "partial": the marker went meanwhile
            yield entry


def newest_committed(root: Storage, *, layouts: Sequence[Layout] = LAYOUTS) -> Iterator[Checkpoint]:
    """Committed checkpoints, newest first, lazily (each by its layout's commit rule;
    contents not verified)."""
    return (e for e in newest_marked(root, layouts=layouts) if e.status == "committed")


def sealed_commit_time(entry: Checkpoint) -> float | None:
    """Another tool's checkpoint's commit time as its seal recorded it (``ckptctl seal``), for
    ``ls`` ages and prune's age and calendar rules: the seal's own file is newer than every
    file of the checkpoint, and a copy gives every file a new mtime, so neither may stand for
    the checkpoint's age. None when there is no seal, it does not parse (``verify`` reports
    it), it is another step's, or it predates the field (the caller falls back to the newest
    modification inside, as before seals recorded it)."""
    if entry.storage is None or entry.owner is None or entry.owner.seal_note is not None:
        return None
    info = entry.storage.stat(SEAL)
    if info is None or info.kind != "file":  # never a FIFO or a link planted under the seal's name
        return None
    try:
        seal = parse_seal(entry.storage.read(SEAL, max_size=MAX_SEAL_BYTES), entry.storage.url_of(SEAL))
    except (InvalidCheckpoint, StorageError, FileNotFoundError):
        return None
    if seal.committed is None or seal.layout != entry.layout or seal.step not in (None, entry.step):
        return None
    return seal.committed


def commit_time(entry: Checkpoint, newest: float) -> float:
    """When ``entry`` (committed) was committed, for ages and time rules: what its manifest
    records, else what its seal records, else ``newest``, the newest modification inside."""
    if entry.manifest is not None:
        return entry.manifest.created
    sealed = sealed_commit_time(entry)
    return sealed if sealed is not None else newest


def recorded_metrics(root: Storage, entries: Iterable[Checkpoint]) -> dict[str, dict[str, float]]:
    """The metrics of each committed entry of ``root``, by name, read without loading data
    (what ``KeepBest`` ranks by): what its save recorded in its manifest, else what its own
    layout reads where its tool records them (``recorded_metrics``: the Trainer's state file).
    A layout reads only its own entries: a Trainer's ``best_model_checkpoint`` never gives a
    metric to another layout's checkpoint of that name."""
    out: dict[str, dict[str, float]] = {}
    asked: dict[str, list[Checkpoint]] = {}
    for entry in entries:
        if entry.status != "committed":
            continue
        if entry.manifest is not None:
            out[entry.name] = dict(entry.manifest.metrics)
        else:
            asked.setdefault(entry.layout, []).append(entry)
    for name, own in asked.items():
        layout = own[0].owner or layout_called(name)
        found = layout.recorded_metrics(root, [(e.name, e.step) for e in own]) if layout is not None else {}
        out.update({e.name: found.get(e.name, {}) for e in own})
    return out
