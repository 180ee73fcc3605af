"""The catalog: the one way every root-wide verb and ``load_latest`` list checkpoints.

A root's children are offered to each known layout (``LAYOUTS``: ckptctl's own, then
torchtitan/DCP, the Hugging Face Trainer, Megatron-LM, DeepSpeed and Lightning's
``*.ckpt`` files, then any third-party layout installed by entry point). A layout first
recognises a child by its name (``step_of``); since two layouts may share a name (``step-N``
is ckptctl's and torchtitan's), the directory belongs to the first one whose files it holds:
ckptctl's marker decides at once, otherwise one listing of the directory is offered to each
(``claims``). A directory no layout claims is listed as ``unknown`` and nothing ever deletes
it. Steps are compared as integers; two entries of one step keep their names' order.

- ``list_checkpoints(root)``: everything, oldest first, each with its cheap status (``ls``,
  ``prune``'s survey).
- ``newest_committed(root)``: committed ones, newest first, lazily (``load_latest``, ``interval``).
- ``newest_marked(root)``: those that claim to be committed, newest first, lazily, corrupt
  ones included (``verify --all/--latest``, ``latest``: they report what they skip).

``load_latest``, ``interval`` statistics and ``restore`` read ckptctl checkpoints only: they
pass ``layouts=NATIVE``. The lazy walks cost one listing and one marker lookup per directory
actually taken, so "the newest that verifies" under thousands of checkpoints (S3: a HEAD each)
stays cheap.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from ckptctl.format.formats import names_among
from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.format.seal import MAX_SEAL_BYTES, SEAL, parse_seal
from ckptctl.layouts.base import UNKNOWN, Checkpoint, Layout
from ckptctl.layouts.accelerate import AccelerateLayout
from ckptctl.layouts.composer import ComposerLayout
from ckptctl.layouts.dcp import DcpLayout
from ckptctl.layouts.deepspeed import DeepSpeedLayout
from ckptctl.layouts.hf_trainer import HfTrainerLayout
from ckptctl.layouts.lightning import LightningLayout
from ckptctl.layouts.megatron import MegatronLayout
from ckptctl.layouts.native import NAME as NATIVE_NAME
from ckptctl.layouts.native import NativeLayout
from ckptctl.layouts.nemo import NemoLayout
from ckptctl.layouts.registry import registered
from ckptctl.storage.base import ObjectInfo, Storage

NATIVE: tuple[Layout, ...] = (NativeLayout(),)
# The built-in layouts, one a line (a new one is its module plus a line here), ckptctl's own
# first: a step-N directory with a ckptctl marker is ckptctl's, whatever else it holds. Their
# names are the shared vocabulary's (``format.formats.LAYOUT_NAMES``: ``latest --format`` and
# ``convert --to`` speak the same names); tests/test_format_names.py checks they agree.
BUILTIN: tuple[Layout, ...] = (
    *NATIVE,
    DcpLayout(),
    HfTrainerLayout(),
    MegatronLayout(),
    DeepSpeedLayout(),
    LightningLayout(),
    AccelerateLayout(),
    ComposerLayout(),
    NemoLayout(),
)
# Every layout: the built-in ones, then third-party ones (entry point group ``ckptctl.layouts``,
# ``layouts.registry``), loaded once, here; a broken plugin is skipped with a warning.
LAYOUTS: tuple[Layout, ...] = registered(BUILTIN)
FORMATS: tuple[str, ...] = tuple(layout.name for layout in LAYOUTS)  # what ``--format`` accepts

_Found = tuple[tuple[Layout, ...], ObjectInfo, int]  # (layouts that know the name, child, step)


def layouts_named(formats: Sequence[str] | None) -> tuple[Layout, ...]:
    """The layouts of ``formats`` (names or aliases of ``format.formats``' vocabulary), all of
    them for None. Raises ValueError naming an unknown one, or a file format that is no layout."""
    if formats is None:
        return LAYOUTS
    wanted = names_among(formats, FORMATS)
    return tuple(layout for layout in LAYOUTS if layout.name in wanted)


def layout_named(name: str, root: Storage) -> Layout:
    """The layout called ``name``, bound to ``root``. Raises KeyError for an unknown name."""
    for layout in LAYOUTS:
        if layout.name == name:
            return layout.for_root(root)
    raise KeyError(name)


def layout_called(name: str) -> Layout | None:
    """The layout called ``name`` as a kind (what it does, not bound to a root: no pointer file
    read); None for ``unknown`` or any other name no layout has."""
    return next((layout for layout in LAYOUTS if layout.name == name), None)


def _scan(root: Storage, layouts: Sequence[Layout]) -> list[_Found]:
    """One listing of ``root``: the children some layout recognises by name, oldest first."""
    bound = [layout.for_root(root) for layout in layouts]
    found: list[_Found] = []
    for child in root.children():
        steps = [(layout, layout.step_of(child)) for layout in bound]
        known = tuple(layout for layout, step in steps if step is not None)
        if known:
            found.append((known, child, next(step for _, step in steps if step is not None)))
    found.sort(key=lambda f: (f[2], f[1].key))
    return found


def count_named(root: Storage, *, layouts: Sequence[Layout] = LAYOUTS) -> int:
    """How many children of ``root`` some layout recognises by name: as many as
    ``list_checkpoints`` lists, from one listing, without reading any of them."""
    return len(_scan(root, layouts))


def _owner(ckpt: Storage, known: Sequence[Layout], kind: str = "dir") -> tuple[Layout | None, bool]:
    """Which layout's checkpoint ``ckpt`` is, and whether that was decided by ckptctl's marker
    (then it is known to be marked without another lookup). A file is a checkpoint only of a
    layout that stores one per file (Lightning), which claims it by its name and contents."""
    if kind == "file":
        return next((layout for layout in known if layout.claims(ckpt, frozenset())), None), False
    for layout in known:
        if layout.name == NATIVE_NAME and layout.is_marked(ckpt):
            return layout, True
    names = frozenset(info.key.rsplit("/", 1)[-1] for info in ckpt.children())
    for layout in known:
        if layout.claims(ckpt, names):
            return layout, False
    return None, False


def _unknown(found: _Found, ckpt: Storage) -> Checkpoint:
    known, child, step = found
    looked = ", ".join(layout.name for layout in known)
    return Checkpoint(step, child.key, ckpt.url, UNKNOWN, "unknown",
                      f"named like a {looked} checkpoint, but no layout recognises its files as its own; "
                      "never deleted", ckpt)


def _entry(root: Storage, found: _Found, owner: Layout | None = None) -> Checkpoint:
    known, child, step = found
    name = child.key
    if child.kind == "link":
        return Checkpoint(step, name, root.url_of(name), known[0].name, "link", "symlink, not followed")
    ckpt = root.sub(name)
    if owner is None:
        owner, _ = _owner(ckpt, known, child.kind)
        if owner is None:
            return _unknown(found, ckpt)
    seen = owner.examine(ckpt)
    if seen.status == "partial" and child.kind == "dir":
        other = _complete_by_another_rule(root, ckpt, owner)
        if other is not None:
            return Checkpoint(step, name, ckpt.url, UNKNOWN, "unknown",
                              f"named like a {owner.name} checkpoint and not complete by its rule ({seen.reason}), "
                              f"but complete by {other}'s; never deleted", ckpt)
    return Checkpoint(step, name, ckpt.url, owner.name, seen.status, seen.reason, ckpt, seen.manifest)


def _complete_by_another_rule(root: Storage, ckpt: Storage, owner: Layout) -> str | None:
    """The name of another layout that claims this directory's files and calls it complete
    (an accelerate ``save_state`` into a directory named ``checkpoint-N`` reads as a Trainer
    save without ``trainer_state.json``), or None. Asked of partial directories only, so a
    directory complete by any known rule is never deleted as an abandoned save."""
    names = frozenset(info.key.rsplit("/", 1)[-1] for info in ckpt.children())
    for layout in LAYOUTS:
        if layout is owner or layout.name == owner.name or layout.files_are_checkpoints:
            continue
        bound = layout.for_root(root)
        if bound.claims(ckpt, names) and bound.examine(ckpt).status == "committed":
            return layout.name
    return None


def list_checkpoints(root: Storage, *, layouts: Sequence[Layout] = LAYOUTS) -> list[Checkpoint]:
    """Every checkpoint directory (and step-named symlink) under ``root``, oldest first, with
    its status from its layout's commit rule only (no data read). Raises only StorageError."""
    return [_entry(root, f) for f in _scan(root, layouts)]


def other_tools_committed(root: Storage) -> list[Checkpoint]:
    """The committed checkpoints under ``root`` of other tools' layouts (not ckptctl's own,
    never an unknown directory or a link), oldest first."""
    return [e for e in list_checkpoints(root) if e.layout not in (NATIVE_NAME, UNKNOWN)
            and e.status == "committed" and e.storage is not None]


def newest_marked(root: Storage, *, step: int | None = None, layouts: Sequence[Layout] = LAYOUTS) -> Iterator[Checkpoint]:
    """Directories that claim to be committed, newest first, lazily: committed, or corrupt
    (claiming to be committed). With ``step``, only directories of that step. Symlinks are
    never followed; directories no layout claims are never taken."""
    for found in reversed(_scan(root, layouts)):
        known, child, found_step = found
        if child.kind == "link" or (step is not None and found_step != step):
            continue
        ckpt = root.sub(child.key)
        owner, marked = _owner(ckpt, known, child.kind)
        if owner is None or not (marked or owner.is_marked(ckpt)):
            continue
        entry = _entry(root, found, owner)
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
    if entry.storage is None or entry.layout in (NATIVE_NAME, UNKNOWN):
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
        layout = layout_called(name)
        found = layout.recorded_metrics(root, [(e.name, e.step) for e in own]) if layout is not None else {}
        out.update({e.name: found.get(e.name, {}) for e in own})
    return out
