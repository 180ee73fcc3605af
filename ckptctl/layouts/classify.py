"""What is at a path or URL: the one answer every verb asks before it acts (``classify``).

A path given to a verb is one of four things, decided here once, through ``Storage`` (so the
same on a local filesystem and under an ``s3://`` prefix):

- ``checkpoint``: one checkpoint of a layout, ckptctl's own included, with that layout bound
  to the root above it (its pointer read) and the checkpoint's storage. Recognised first by its
  name under its parent and its files, as the catalog recognises a root's children (each
  layout's ``step_of`` and ``claims``: ``step-N``, ``checkpoint-N``, ``iter_N``,
  ``global_stepN``, a Lightning ``*step=N*.ckpt`` file); then by its files alone, whatever its
  name (each layout's ``claims_alone``: ckptctl's marker, manifest or shards; DCP's
  ``.metadata`` or ``*.distcp``), so a DCP directory named alone is the DCP layout's checkpoint
  and is verified by that layout's check, exactly as under a root;
- ``file``: a file format another tool's reader takes (a ``.safetensors`` or ``torch.save``
  file, a directory of safetensors such as a Hugging Face export);
- ``root``: a directory holding checkpoints (``entries``: how many the catalog names);
- ``nothing``: ``missing`` (no such path, or an empty prefix), or nothing any rule recognises
  (``reason``, as the errors of ``ops.targets`` say it).

The answers are tried in that order, so one path has one answer: a Trainer's ``output_dir``
holds ``checkpoint-N`` directories *and* its final ``model.safetensors``; as one checkpoint it
is that export (``file``), and ``ls``, which lists before it asks, still lists its entries. Two
fallbacks keep the readers' own messages: a directory named like ckptctl's ``step-N`` that no
layout claims is ckptctl's by name (``claimed`` False: its reader says "not committed"), and
on object storage a prefix no layout claims is recognised by the seal it holds (``by_seal``:
``cp`` of a sealed copy).

The path itself, as the user named it, may be a symlink (users point ``/ckpt`` at a volume):
it is followed for what its files say, but a link is never taken for a checkpoint by its name,
since under a root the catalog never follows one either. Nothing below the path is followed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.format.seal import MAX_SEAL_BYTES, SEAL, check_seal_size, parse_seal
from ckptctl.interop.detect import foreign_format, format_by_name
from ckptctl.layouts.base import Checkpoint, Layout
from ckptctl.layouts.catalog import LAYOUTS, NATIVE, count_named, layouts_named, list_checkpoints
from ckptctl.storage import Storage, open_storage
from ckptctl.storage.base import ObjectInfo

What = Literal["checkpoint", "file", "root", "nothing"]

MISSING = "no such file or directory"
NO_FORMAT_FILE = "a file of no checkpoint format"
NO_FORMAT_DIR = "no manifest, marker, DCP .metadata or .safetensors in it"


@dataclass
class Found:
    """What ``classify`` found at ``path`` (see the module's docstring)."""

    path: str  # as given
    what: What
    storage: Storage  # at the path: the checkpoint (key "" for a one-file checkpoint), the file, the root
    layout: Layout | None = None  # checkpoint: its layout, bound to the root above it
    format: str | None = None  # file: "safetensors" or "torch"
    entries: int = 0  # root: how many checkpoints the catalog names under it
    missing: bool = False  # nothing: no such path (an empty prefix on object storage)
    reason: str | None = None  # nothing: why not (MISSING, NO_FORMAT_FILE, NO_FORMAT_DIR)
    by_name: bool = False  # checkpoint: recognised by its name under its parent (not by its files alone)
    by_seal: bool = False  # checkpoint: on object storage, recognised by its seal (its name checked against it)
    empty: bool = False  # checkpoint: a directory named like one holding nothing yet
    claimed: bool = True  # checkpoint: its layout claims its files (False: by its name alone)
    is_dir: bool = False
    _file_format: str | None = field(default=None, repr=False)

    @property
    def in_layout(self) -> Layout:
        """The checkpoint's layout, bound to its root; raises ValueError when this is no
        layout's checkpoint (ask ``what`` first)."""
        if self.what != "checkpoint" or self.layout is None:
            raise ValueError(f"{self.path} is no layout's checkpoint ({self.what})")
        return self.layout

    @property
    def verified_by_manifest(self) -> bool:
        """One of ckptctl's own checkpoints (its layout's ``verified_by_manifest``)."""
        return self.what == "checkpoint" and self.layout is not None and self.layout.verified_by_manifest

    @property
    def local(self) -> str | None:
        """The local path readers of other tools' formats take; None on object storage."""
        return self.storage.local_path()

    @property
    def name(self) -> str:
        return self.storage.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def step(self) -> int | None:
        """The step the checkpoint's name stands for in its layout, or None (a DCP directory
        named alone, a file format, anything else)."""
        if self.layout is None or self.what != "checkpoint" or not (self.by_name or self.by_seal):
            return None
        return self.layout.step_of(ObjectInfo(self.name, 0, 0.0, "dir" if self.is_dir else "file"))

    def file_format(self) -> str | None:
        """The format another tool's reader (``interop``) reads this as: a file's own, or for a
        local checkpoint directory what its files are (DCP, safetensors); None when no reader
        takes it or it is on object storage (those readers take local paths)."""
        if self.format is not None:
            return self.format
        if self._file_format is None and self.local is not None:
            self._file_format = foreign_format(self.local) or ""
        return self._file_format or None

    @property
    def description(self) -> str | None:
        """What the path is, for a message that it is not a root ("a ckptctl checkpoint",
        "a dcp checkpoint", "a lightning checkpoint file", "an empty ckptctl checkpoint
        directory"); None for a root, nothing, or a single file no layout claims."""
        if self.what == "checkpoint" and self.layout is not None:
            if self.empty and self.layout.verified_by_manifest:  # a dead save of ours (others say less)
                return f"an empty {self.layout.name} checkpoint directory"
            if self.claimed:
                return f"a {self.layout.name} checkpoint" + (" file" if self.layout.files_are_checkpoints else "")
        if self.what == "file" and self.is_dir:
            return f"a {self.format} checkpoint"
        return None

    def checkpoints(self) -> list[Checkpoint]:
        """The catalog's entries under the path (a root's checkpoints), oldest first."""
        return list_checkpoints(self.storage) if self.is_dir else []


def _parent(path: str, st: Storage) -> tuple[Storage, str] | None:
    """The storage above ``path`` and the path's name in it; None for a filesystem's ``/``,
    a bucket or a bare scheme, which no root holds."""
    local = st.local_path()
    if local is not None:
        full = os.path.abspath(local)
        head, name = os.path.split(full)
        return (open_storage(head), name) if name else None
    head, _, name = path.rstrip("/").rpartition("/")
    if not name or "://" not in head or head.endswith(":/"):
        return None
    return open_storage(head), name


def _by_name(path: str, root: Storage, name: str, info: ObjectInfo | None, st: Storage) -> Found | None:
    """One checkpoint of a layout by its name under ``root`` and its files, as the catalog
    decides a root's child (``catalog._owner``); None when no layout claims it."""
    kind = "file" if info is not None and info.kind == "file" else "dir"
    ckpt = root.sub(name)
    names = frozenset(c.key.rsplit("/", 1)[-1] for c in ckpt.children()) if kind == "dir" else frozenset()
    if info is None and not names:
        return None
    child = ObjectInfo(name, 0, 0.0, kind)
    for layout in LAYOUTS:
        if layout.step_of(child) is None:  # by name alone: no layout reads its root's pointer for that
            continue
        bound = layout.for_root(root)
        if bound.claims(ckpt, names):
            # A manifest-verified checkpoint is read as the user named it (its URL as given);
            # another tool's is bound below its root, never through a link (checked above).
            where = st if bound.verified_by_manifest else ckpt
            return Found(path, "checkpoint", where, bound, by_name=True, empty=not names and kind == "dir",
                         is_dir=kind == "dir")
    return None


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
    return Found(path, "checkpoint", st, layout, by_seal=True, is_dir=True)


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
    if above is not None and (info is None or info.kind != "link"):
        found = _by_name(path, above[0], above[1], info, st)
        if found is not None:
            return found
    # The path itself, a link named by the user followed (its files are listed without following).
    is_dir = os.path.isdir(local) if local is not None else (info is None or info.kind == "dir")
    names = frozenset(c.key.rsplit("/", 1)[-1] for c in st.children()) if is_dir else frozenset()
    name = above[1] if above is not None else ""
    if names:
        bound_to = above[0] if above is not None else st
        for layout in LAYOUTS:
            claims_alone = getattr(layout, "claims_alone", None)  # a plugin may predate it
            if claims_alone is not None and claims_alone(st, names):
                return Found(path, "checkpoint", st, layout.for_root(bound_to), is_dir=True)
        if local is None:
            found = _by_seal(path, st, name)
            if found is not None:
                return found
    fmt = foreign_format(local) if local is not None else format_by_name(name, "dir" if is_dir else "file", names)
    if fmt is not None:
        return Found(path, "file", st, format=fmt, is_dir=is_dir)
    if is_dir:
        n = count_named(st)
        if n:
            return Found(path, "root", st, entries=n, is_dir=True)
        unlinked = info is None or info.kind != "link"
        named = NATIVE[0].step_of(ObjectInfo(name, 0, 0.0, "dir")) is not None  # ckptctl's own name rule
        if named and unlinked and (names or local is not None):
            # Named like one of ckptctl's step directories, holding nothing any layout claims
            # (yet): ckptctl's reader says what is missing ("not committed").
            return Found(path, "checkpoint", st, NATIVE[0], by_name=True, empty=not names, claimed=False,
                         is_dir=True)
    if local is None and not names and info is None:
        return Found(path, "nothing", st, missing=True, reason=MISSING)  # no object, no prefix
    return Found(path, "nothing", st, reason=NO_FORMAT_DIR if is_dir else NO_FORMAT_FILE, is_dir=is_dir)


def checkpoint_below(path: str) -> Found | None:
    """``classify(path)`` when it is one checkpoint of a layout recognised by its name under
    its root (what the catalog would list there), else None. Never raises for what is at the
    path; a storage that cannot be read is None too (the caller's own errors apply)."""
    try:
        found = classify(path)
    except (StorageError, InvalidCheckpoint):
        return None
    return found if found.what == "checkpoint" and found.by_name and found.claimed else None


__all__ = ["Found", "MISSING", "NO_FORMAT_DIR", "NO_FORMAT_FILE", "What", "checkpoint_below", "classify"]
