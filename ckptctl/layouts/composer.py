"""MosaicML Composer: ``ep{epoch}-ba{batch}-rank{rank}.pt`` files in the save folder.

    ROOT/ep1-ba42-rank0.pt            one torch.save file per checkpoint (monolithic: rank 0 only)
    ROOT/ep2-ba84-rank0.pt
    ROOT/latest-rank0.pt -> ep2-ba84-rank0.pt    symlink to the newest save (autoresume reads it)
    ROOT/latest-rank0.pt.symlink                 on object storage: a file holding the target's name

Built from Composer's source, not from a run (Composer does not install beside this project's
torch): composer/callbacks/checkpoint_saver.py (``CheckpointSaver``: default ``filename``
``ep{epoch}-ba{batch}-rank{rank}.pt``, ``latest_filename`` ``latest-rank{rank}.pt``;
``_save_checkpoint`` saves, then removes the old symlink and ``os.symlink``-s the new one, and
``_rotate_checkpoints`` ``os.remove``-s the oldest) and composer/utils/checkpoint.py
(``_save_checkpoint``: rank 0 writes ``{'state': state.state_dict(), 'rng': get_rng_state()}``
with ``torch.save`` straight into the final name, ``open(filename, 'wb')``, no temporary and no
rename; ``weights_only=True`` saves ``{'state': {'model', 'integrations', 'metadata'}}``). As
read from mosaicml/composer at commit 6405188 (2026-04), unverified against a real run.

Commit rule: a file is complete when it is a whole ``torch.save`` archive (its zip directory,
written last, parses); a truncated one is Composer's own save cut short. The step is the batch
count (``ba{batch}``). The symlink is the pointer: ``Trainer(autoresume=True)`` loads what it
names (trainer.py, ``_get_autoresume_checkpoint``), so prune keeps its target, and the symlink
itself (no batch in its name) is never listed, so never deleted. Resumable: the file's state
holds ``optimizers`` and ``rng`` (read from the pickle's strings, nothing run); a
``weights_only`` save is an export.

Files are test-loaded with ``torch.load(weights_only=True)`` and the globals Composer's own
loader allows (``_COMPOSER_CHECKPOINT_SAFE_GLOBALS``: ``datetime.timedelta``, numpy arrays and
dtypes, ``TorchVersion``); Composer loads its checkpoints the same way, so a file needing more
would not resume in Composer either.
Weakness: the write is in place, so a kill mid-save leaves a truncated file under the final
name (read here as partial); the symlink is replaced by remove-then-create, so a kill between
the two leaves no pointer (autoresume then starts from scratch). Compressed (``.pt.gz``,
``.pt.lz4``, ...) and ``.tar`` (DeepSpeed) files and FSDP sharded folders are not read (not
listed, never deleted); only the default file name is recognised.
"""

from __future__ import annotations

import datetime
import os
import pickletools
import posixpath
import re
import zipfile
from typing import Iterable

from ckptctl.format.manifest import Manifest
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.file_check import FileKind
from ckptctl.layouts.stack import StackLayout, whole_torch_file
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import open_file

NAME = "composer"
NAME_RE = re.compile(r"ep([0-9]{1,18})-ba([0-9]{1,18})-rank([0-9]{1,9})\.pt\Z", re.ASCII)
LATEST = "latest-rank0.pt"  # rank 0's symlink: the one autoresume broadcasts to every rank
LATEST_REMOTE = LATEST + ".symlink"  # what Composer uploads in the symlink's place
MAX_STATE_PICKLE = 64 << 20  # data.pkl holds names and small values; tensors are separate members


class ComposerLayout(StackLayout):
    name = NAME
    title = "MosaicML Composer"
    pattern = NAME_RE
    files_are_checkpoints = True
    seal_note = "a checkpoint that is one file (Composer's *.pt) has no directory to hold a seal"
    pointer_file = LATEST

    def __init__(self) -> None:
        super().__init__()
        self.latest: str | None = None  # the file name latest-rank0.pt names, when it names one here

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        extra: list[object] = [datetime.timedelta]
        try:
            from torch.torch_version import TorchVersion

            extra.append(TorchVersion)  # a str subclass: building one runs no code of the file
        except ImportError:
            pass
        return (*extra, *safe_load.numpy_rng())

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind != "file":  # latest-rank0.pt is a symlink, and has no batch in its name anyway
            return None
        return self.step_in_name(child.key.rsplit("/", 1)[-1])

    def step_in_name(self, name: str) -> int | None:
        m = NAME_RE.match(name)
        return int(m.group(2)) if m is not None else None  # the batch: Composer's step

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        return safe_load.regular_size(ckpt, "") is not None  # never a link, a FIFO or a directory

    def read_root(self, root: Storage) -> None:
        self.latest = _latest_target(root)

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        return whole_torch_file(ckpt, "Composer writes in place, so this save did not finish")

    def kind_of(self, rel: str) -> FileKind:
        return "torch"

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        keys = _state_strings(ckpt)
        if keys is None:
            return CheckpointKind("resumable", "its state's keys could not be read, so not told apart")
        if "optimizers" in keys and "rng" in keys:
            return CheckpointKind("resumable", "holds optimizers and rng state")
        return CheckpointKind("export", "no optimizers or rng state: a weights_only save")

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        if self.latest is None:
            return {}
        return {self.latest: f"{LATEST} names it (Trainer(autoresume=True) resumes from it)"}

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        if self.latest is None:
            return None
        return LATEST, self.latest, self.step_in_name(self.latest)

    def resume(self, ckpt_path: str, step: int) -> Resume:
        # autoresume=True would load what latest-rank0.pt names instead of load_path.
        return Resume(ckpt_path, f"Trainer(load_path={ckpt_path!r}, autoresume=False)", ("--load_path", ckpt_path))


def _latest_target(root: Storage) -> str | None:
    """The file name rank 0's ``latest`` symlink names in ``root``: the link itself on a local
    disk (read, never followed), or the ``.symlink`` file Composer uploads to object storage.
    None when there is none, or it names something outside the root."""
    local = root.local_path()
    target: str | None = None
    if local is not None:
        try:
            target = os.readlink(os.path.join(local, LATEST))
        except (OSError, ValueError):  # no link (or a plain file there): no pointer
            target = None
        if target is not None and "/" in target:
            return None  # CheckpointSaver links to a file beside the link; this names one elsewhere
    if target is None:
        text = safe_load.read_pointer(root, LATEST_REMOTE, 4096)
        target = text or None
    if target is None:
        return None
    # A relative link to a file beside it, as CheckpointSaver makes it; a remote name is a path
    # from the bucket's root whose last part is the file.
    base = posixpath.basename(target.rstrip("/"))
    return base if NAME_RE.match(base) else None


def _state_strings(ckpt: Storage) -> set[str] | None:
    """The strings in the archive's ``data.pkl`` (dict keys among them), read opcode by opcode
    with ``pickletools`` (nothing is run); None when the archive or its pickle cannot be read."""
    f = open_file(ckpt, "")
    if f is None:
        return None
    try:
        with f, zipfile.ZipFile(f) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1 or z.getinfo(pkl[0]).file_size > MAX_STATE_PICKLE:
                return None
            raw = z.read(pkl[0])
        return {arg for op, arg, _pos in pickletools.genops(raw) if isinstance(arg, str) and "UNICODE" in op.name}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, UnicodeDecodeError, IndexError,
            KeyError, TypeError):  # a damaged or hostile archive: nothing to tell
        return None
