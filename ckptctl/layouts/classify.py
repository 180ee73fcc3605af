"""What is at a path or URL, and which layout owns a directory: the one answer every verb (and
the catalog) asks before it acts.

A path given to a verb is one of four things, decided here once, through ``Storage`` (so the
same on a local filesystem and under an ``s3://`` prefix):

- ``checkpoint``: one checkpoint of a layout, ckptctl's own included, with that layout bound
  to the root above it (its pointer read) and the checkpoint's storage. Recognised first by its
  name under its parent and its files, as the catalog recognises a root's children (``owner``:
  each layout's ``step_of`` and ``claims``: ``step-N``, ``checkpoint-N``, ``iter_N``,
  ``global_stepN``, a Lightning ``*step=N*.ckpt`` file); then by its files alone, whatever its
  name (each layout's ``claims_alone``: ckptctl's marker, manifest or shards; DCP's
  ``.metadata`` or ``*.distcp``), so a DCP directory named alone is the DCP layout's checkpoint
  and is verified by that layout's check, exactly as under a root;
- ``file``: a file format another tool's reader takes (``files``: a ``.safetensors`` or
  ``torch.save`` file, a directory of safetensors such as a Hugging Face export), handled by a
  ``files.FileFormat``;
- ``root``: a directory holding checkpoints (``entries``: how many some layout names);
- ``nothing``: ``missing`` (no such path, or an empty prefix), or nothing any rule recognises
  (``reason``, as the errors of ``ops.targets`` say it).

The answers are tried in that order, so one path has one answer: a Trainer's ``output_dir``
holds ``checkpoint-N`` directories *and* its final ``model.safetensors``; as one checkpoint it
is that export (``file``), and ``ls``, which lists before it asks, still lists its entries. Two
fallbacks keep the readers' own messages: a directory named like ckptctl's ``step-N`` that no
layout claims is ckptctl's by name (``claimed`` False: its check says "not committed"), and
on object storage a prefix no layout claims is recognised by the seal it holds (``by_seal``:
``cp`` of a sealed copy).

Under a root (the catalog, ``named_children`` and ``owner``): a child is offered to each layout
that knows its name; since two layouts may share a name, the directory belongs to the first
one whose files it holds, ckptctl's marker deciding at once; and a partial directory complete
by another known rule (``rival``) is ``unknown``, never an abandoned save to delete.

The path itself, as the user named it, may be a symlink (users point ``/ckpt`` at a volume):
it is followed for what its files say, but a link is never taken for a checkpoint by its name,
since under a root the catalog never follows one either. Nothing below the path is followed.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.format.seal import MAX_SEAL_BYTES, SEAL, check_seal_size, parse_seal
from ckptctl.interop.detect import Format
from ckptctl.layouts.base import Layout, ModelWeights, model_weights
from ckptctl.layouts.checked import ALONE, Checked, Level, Split
from ckptctl.layouts.files import NO_FORMAT_DIR, FileFormat, Unfinished, format_by_name, format_of
from ckptctl.layouts.inspected import Inspected
from ckptctl.layouts.native import NativeLayout
from ckptctl.layouts.registry import LAYOUTS, layouts_named
from ckptctl.layouts.stack import StackLayout
from ckptctl.progress import Progress
from ckptctl.storage import Storage, open_storage
from ckptctl.storage.base import ObjectInfo, is_key

What = Literal["checkpoint", "file", "root", "nothing"]

MISSING = "no such file or directory"
NO_FORMAT_FILE = "a file of no checkpoint format"
_BY_NAME = NativeLayout()  # whose name rule decides a step-N directory no layout claims (yet)

Named = tuple[tuple[Layout, ...], ObjectInfo, int]  # (layouts that know the name, child, step)


# --- a root's children -------------------------------------------------------------------------


def named_children(root: Storage, layouts: Sequence[Layout],
                   children: Sequence[ObjectInfo] | None = None) -> list[Named]:
    """One listing of ``root`` (``children``: the one the caller just made): the children some
    layout of ``layouts`` names as a checkpoint of some step, oldest first (steps as integers;
    one step's entries in their names' order)."""
    listed = root.children() if children is None else children
    bound = [_bind(layout, root, listed) for layout in layouts]
    found: list[Named] = []
    for child in listed:
        if not is_key(child.key):
            continue  # a local name no key may hold (a backslash): never read, listed or deleted
        steps = [(layout, layout.step_of(child)) for layout in bound]
        known = tuple(layout for layout, step in steps if step is not None)
        if known:
            found.append((known, child, next(step for _, step in steps if step is not None)))
    found.sort(key=lambda f: (f[2], f[1].key))
    return found


def _bind(layout: Layout, root: Storage, children: Sequence[ObjectInfo]) -> Layout:
    """``layout.for_root(root)``; on object storage a built-in stack's pointer that ``children``
    (the root's listing) lacks costs no request (``StackLayout.for_listed_root``)."""
    if isinstance(layout, StackLayout) and root.local_path() is None:
        return layout.for_listed_root(root, children)
    return layout.for_root(root)


def _names(ckpt: Storage) -> frozenset[str]:
    return _names_in(ckpt.children())


def _names_in(children: Sequence[ObjectInfo]) -> frozenset[str]:
    return frozenset(info.key.rsplit("/", 1)[-1] for info in children)


def marked(layout: Layout, ckpt: Storage) -> bool:
    """Whether ``ckpt`` claims to be committed by ``layout``'s rule: one lookup of its commit
    marker where it has one, else its commit rule (committed or corrupt, not partial)."""
    if layout.commit_marker is not None:
        return ckpt.stat(layout.commit_marker) is not None
    return layout.examine(ckpt).status != "partial"


def owner(ckpt: Storage, known: Sequence[Layout], kind: str = "dir") -> tuple[Layout | None, bool]:
    """Which of ``known`` (the layouts that name it, bound to its root) owns ``ckpt``, and
    whether that was decided by a commit marker (then it is known to be marked without another
    lookup). A file is a checkpoint only of a layout that stores one per file (Lightning),
    which claims it by its name and contents."""
    if kind == "file":
        return next((layout for layout in known if layout.claims(ckpt, frozenset())), None), False
    # The first layout's marker decides at once: ckptctl's own, first of the built-in layouts.
    first = known[0] if known else None
    if first is not None and first.commit_marker is not None and ckpt.stat(first.commit_marker) is not None \
            and first.claims(ckpt, frozenset({first.commit_marker})):
        return first, True
    names = _names(ckpt)
    return next((layout for layout in known if layout.claims(ckpt, names)), None), False


def rival(root: Storage, ckpt: Storage, own: Layout) -> str | None:
    """The name of another layout that claims this directory's files and calls it complete
    (an accelerate ``save_state`` into a directory named ``checkpoint-N`` reads as a Trainer
    save without ``trainer_state.json``), or None. Asked of partial directories only, so a
    directory complete by any known rule is never deleted as an abandoned save."""
    names = _names(ckpt)
    for layout in LAYOUTS:
        if layout is own or layout.name == own.name or layout.files_are_checkpoints:
            continue
        bound = layout.for_root(root)
        if bound.claims(ckpt, names) and bound.examine(ckpt).status == "committed":
            return layout.name
    return None


# --- a path ------------------------------------------------------------------------------------


@dataclass
class Found:
    """What ``classify`` found at ``path`` (see the module's docstring)."""

    path: str  # as given
    what: What
    storage: Storage  # at the path: the checkpoint (key "" for a one-file checkpoint), the file, the root
    layout: Layout | None = None  # checkpoint: its layout, bound to the root above it
    format: Format | None = None  # file: "safetensors" or "torch"
    entries: int = 0  # root: how many checkpoints some layout names under it
    missing: bool = False  # nothing: no such path (an empty prefix on object storage)
    reason: str | None = None  # nothing: why not (MISSING, NO_FORMAT_FILE, NO_FORMAT_DIR)
    by_name: bool = False  # checkpoint: recognised by its name under its parent (not by its files alone)
    by_seal: bool = False  # checkpoint: on object storage, recognised by its seal (its name checked against it)
    empty: bool = False  # checkpoint: a directory named like one holding nothing yet
    claimed: bool = True  # checkpoint: its layout claims its files (False: by its name alone)
    is_dir: bool = False
    name: str = ""  # its name under its parent ("" for a filesystem's / or a bucket)
    names: frozenset[str] = frozenset()  # a directory's immediate children
    # root: its listing, for the verb's catalog of it (``named_children``): not listed again
    children: tuple[ObjectInfo, ...] | None = field(default=None, repr=False)
    _file_format: str | None = field(default=None, repr=False)

    @property
    def in_layout(self) -> Layout:
        """The checkpoint's layout, bound to its root; raises ValueError when this is no
        layout's checkpoint (ask ``what`` first)."""
        if self.what != "checkpoint" or self.layout is None:
            raise ValueError(f"{self.path} is no layout's checkpoint ({self.what})")
        return self.layout

    @property
    def handler(self) -> "Layout | FileFormat":
        """What checks and shows it: its layout, or its file format's handler. Raises
        ValueError for a root or nothing (ask ``what`` first)."""
        if self.what == "file" and self.format is not None:
            return FileFormat(self.format)
        return self.in_layout

    def check(self, level: Level, *, split: Split = ALONE, progress: Progress | None = None) -> Checked:
        """``handler.check`` of what is here."""
        return self.handler.check(self.storage, level, split=split, progress=progress)

    def inspect(self, *, tensors: bool = False) -> Inspected:
        """``handler.inspect`` of what is here."""
        return self.handler.inspect(self.storage, tensors=tensors)

    @property
    def local(self) -> str | None:
        """The local path other tools' readers take; None on object storage."""
        return self.storage.local_path()

    @property
    def step(self) -> int | None:
        """The step the checkpoint's name stands for in its layout, or None (a DCP directory
        named alone, a file format, anything else)."""
        if self.layout is None or self.what != "checkpoint" or not (self.by_name or self.by_seal):
            return None
        return self.layout.step_of(ObjectInfo(self.name, 0, 0.0, "dir" if self.is_dir else "file"))

    def reader_format(self) -> Format | None:
        """The format a reader (``convert``, ``reshard``, ``interop``) reads this as: a file's
        own; for a directory what its files are (``ckptctl``: its manifest; DCP, safetensors);
        None when no reader takes it. Raises ``files.Unfinished`` (InvalidCheckpoint) for DCP
        records without the ``.metadata`` DCP writes last."""
        if self.format is not None:
            return self.format
        if self.local is not None:
            return format_of(self.local)
        return format_by_name(self.name, "dir" if self.is_dir else "file", self.names)

    def model_weights(self) -> ModelWeights | None:
        """For a local checkpoint of a layout whose files no format reader takes whole, the file
        its layout says holds the model weights (``Layout.model_weights``); None otherwise."""
        if self.what != "checkpoint" or self.layout is None or self.local is None:
            return None
        return model_weights(self.layout, self.storage)

    def file_format(self) -> Format | None:
        """``reader_format``, None for an unfinished DCP save too (no reader takes it)."""
        if self._file_format is None:
            try:
                self._file_format = self.reader_format() or ""
            except Unfinished:
                self._file_format = ""
        return self._file_format or None  # type: ignore[return-value]

    @property
    def description(self) -> str | None:
        """What the path is, for a message that it is not a root ("a ckptctl checkpoint",
        "a dcp checkpoint", "a lightning checkpoint file", "an empty ckptctl checkpoint
        directory"); None for a root, nothing, or a single file no layout claims."""
        if self.what == "checkpoint" and self.layout is not None:
            if self.empty:
                return f"an empty {self.layout.name} checkpoint directory"
            if self.claimed:
                return f"a {self.layout.name} checkpoint" + (" file" if self.layout.files_are_checkpoints else "")
        if self.what == "file" and self.is_dir:
            return f"a {self.format} checkpoint"
        return None


def _parent(path: str, st: Storage) -> tuple[Storage, str] | None:
    """The storage above ``path`` and the path's name in it; None for a filesystem's ``/``,
    a bucket or a bare scheme, which no root holds."""
    local = st.local_path()
    if local is not None:
        full = os.path.abspath(local)
        head, name = os.path.split(full)
        # A local name holds any character but NUL and "/"; one that no key may hold (a
        # backslash) cannot be looked up beside its siblings, so the path is read as itself,
        # as "/" is: a root by its children, a checkpoint by its own files.
        return (open_storage(head), name) if name and is_key(name) else None
    head, _, name = path.rstrip("/").rpartition("/")
    if not name or "://" not in head or head.endswith(":/"):
        return None
    return open_storage(head), name


def _by_name(path: str, root: Storage, name: str, info: ObjectInfo | None, st: Storage,
             listing: Callable[[], list[ObjectInfo]]) -> Found | None:
    """One checkpoint of a layout by its name under ``root`` and its files, as the catalog
    decides a root's child (``owner``); None when no layout claims it. ``listing``: the
    children of ``st`` (listed once per ``classify``), asked only when a layout knows the name."""
    kind = "file" if info is not None and info.kind == "file" else "dir"
    child = ObjectInfo(name, 0, 0.0, kind)
    naming = [layout for layout in LAYOUTS if layout.step_of(child) is not None]
    if not naming:
        return None
    names = _names_in(listing()) if kind == "dir" else frozenset()
    if info is None and not names:
        return None
    known = [layout.for_root(root) for layout in naming]
    found, _ = owner(root.sub(name), known, kind)
    if found is None:
        return None
    # Read as the user named it (its URL as given); never through a link (checked above).
    return Found(path, "checkpoint", st, found, by_name=True, empty=not names and kind == "dir",
                 is_dir=kind == "dir", name=name, names=names)


def _by_seal(path: str, st: Storage, name: str) -> Found | None:
    """A prefix on object storage recognised by the seal it holds (``ckptctl seal``, then
    ``cp``): the layout the seal names. Raises InvalidCheckpoint for a seal of a layout this
    ckptctl does not know, or under a name that layout gives no checkpoint."""
    info = st.stat(SEAL)
    if info is None:
        return None
    check_seal_size(info.size, st.url_of(SEAL))
    seal = parse_seal(st.read(SEAL, max_size=MAX_SEAL_BYTES), st.url_of(SEAL))
    try:
        known = layouts_named([seal.layout])
    except ValueError:  # a name this ckptctl does not know
        known = ()
    layout = known[0] if known else None
    if layout is None or layout.seal_note is not None:
        raise InvalidCheckpoint(f"{st.url_of(SEAL)}: sealed as a {seal.layout!r} checkpoint, a layout this "
                                "ckptctl does not know", hint="upgrade ckptctl")
    if layout.step_of(ObjectInfo(name, 0, 0.0, "dir")) is None:
        raise InvalidCheckpoint(f"{st.url}: named {name!r}, not a {layout.name} checkpoint directory, "
                                "but sealed as one",
                                hint="copy the checkpoint under the name it was sealed with")
    return Found(path, "checkpoint", st, layout, by_seal=True, is_dir=True, name=name)


def _foreign(local: str | None, name: str, is_dir: bool, names: frozenset[str]) -> Format | None:
    """The file format a reader of another tool takes this as (never ckptctl's own, a layout's)."""
    try:
        fmt = format_of(local) if local is not None else format_by_name(name, "dir" if is_dir else "file", names)
    except Unfinished:
        return None
    return fmt if fmt in ("safetensors", "torch") else None


def classify(path: str) -> Found:
    """What is at ``path`` (a local path or a URL). Raises only StorageError (the storage
    could not be read) and InvalidCheckpoint (a seal on object storage that contradicts its
    prefix); every other answer is a ``Found``."""
    st = open_storage(path)
    local = st.local_path()
    if local is not None and not os.path.lexists(local):
        return Found(path, "nothing", st, missing=True, reason=MISSING)
    above = _parent(path, st)
    info = above[0].stat(above[1]) if above is not None else None
    # The directory at the path, listed once: asked by its name's layouts, then for itself.
    listing = functools.cache(st.children)
    if above is not None and (info is None or info.kind != "link"):
        found = _by_name(path, above[0], above[1], info, st, listing)
        if found is not None:
            return found
    # The path itself, a link named by the user followed (its files are listed without following).
    is_dir = os.path.isdir(local) if local is not None else (info is None or info.kind == "dir")
    names = _names_in(listing()) if is_dir else frozenset()
    name = above[1] if above is not None else ""
    if names:
        bound_to = above[0] if above is not None else st
        for layout in LAYOUTS:
            if layout.claims_alone(st, names):
                return Found(path, "checkpoint", st, layout.for_root(bound_to), is_dir=True, name=name, names=names)
        if local is None and SEAL in names:  # the listing says whether a seal is there
            found = _by_seal(path, st, name)
            if found is not None:
                return found
    fmt = _foreign(local, name, is_dir, names)
    if fmt is not None:
        return Found(path, "file", st, format=fmt, is_dir=is_dir, name=name, names=names)
    if is_dir:
        children = listing()
        n = len(named_children(st, LAYOUTS, children))
        if n:
            return Found(path, "root", st, entries=n, is_dir=True, name=name, names=names, children=tuple(children))
        unlinked = info is None or info.kind != "link"
        named = _BY_NAME.step_of(ObjectInfo(name, 0, 0.0, "dir")) is not None
        if named and unlinked and (names or local is not None):
            # Named like one of ckptctl's step directories, holding nothing any layout claims
            # (yet): ckptctl's check says what is missing ("not committed").
            return Found(path, "checkpoint", st, _BY_NAME, by_name=True, empty=not names, claimed=False,
                         is_dir=True, name=name, names=names)
    if local is None and not names and info is None:
        return Found(path, "nothing", st, missing=True, reason=MISSING)  # no object, no prefix
    return Found(path, "nothing", st, reason=NO_FORMAT_DIR if is_dir else NO_FORMAT_FILE, is_dir=is_dir, name=name)


def checkpoint_below(path: str) -> Found | None:
    """``classify(path)`` when it is one checkpoint of a layout recognised by its name under
    its root (what the catalog would list there), else None. Never raises for what is at the
    path; a storage that cannot be read is None too (the caller's own errors apply)."""
    try:
        found = classify(path)
    except (StorageError, InvalidCheckpoint):
        return None
    return found if found.what == "checkpoint" and found.by_name and found.claimed else None


__all__ = ["Found", "MISSING", "NO_FORMAT_DIR", "NO_FORMAT_FILE", "What", "checkpoint_below", "classify",
           "marked", "named_children", "owner", "rival"]
