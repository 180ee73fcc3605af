"""Lightning: ``*.ckpt`` files with the step in their name, in ``ModelCheckpoint``'s dirpath.

    ROOT/epoch=0-step=100.ckpt       one torch.save file per checkpoint
    ROOT/epoch=1-step=200.ckpt
    ROOT/last.ckpt                   save_last: a copy, or a symlink ("link")

Commit rule (lightning/pytorch/callbacks/model_checkpoint.py, ``ModelCheckpoint``, names
files ``{epoch}-{step}`` as ``epoch=E-step=S.ckpt``; lightning/fabric/utilities/cloud_io.py,
``_atomic_save``, serialises the whole checkpoint in memory and writes it inside an fsspec
transaction, which on a local disk writes a file in the *system* temporary directory and
``shutil.move``-s it into place: a rename on one filesystem, a copy across two, so a kill
mid-copy leaves a truncated ``.ckpt``): a file is complete when it is a whole ``torch.save``
archive (its zip directory, written last, parses); a truncated one is Lightning's own
incomplete save. Each file is one checkpoint: the catalog lists files, not directories,
for this layout only. ``last.ckpt`` has no step in its name and is never listed, so nothing
deletes it; the ``best_model_path`` that ``ModelCheckpoint`` records inside the newest
complete file is protected by prune as Lightning's own ``save_top_k`` keeps it.

Files are test-loaded with ``torch.load(weights_only=True)``; what a LightningModule puts in
``hyper_parameters`` beyond plain values is reported as not test-loaded, never unpickled.
Weakness: sharded strategies (FSDP, DeepSpeed) write a ``*.ckpt`` *directory* instead; those
are not read here yet (not listed, so never deleted).
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from ckptctl.layouts import safe_load
from ckptctl.layouts.base import Examined
from ckptctl.layouts.stack import FileKind, Resume, StackLayout
from ckptctl.storage.base import ObjectInfo, Storage

NAME_RE = re.compile(r"(?:.*[^0-9A-Za-z])?step=([0-9]{1,18})(?:[^0-9].*)?\.ckpt\Z", re.ASCII)


class LightningLayout(StackLayout):
    name = "lightning"
    title = "Lightning"
    pattern = NAME_RE
    files_are_checkpoints = True

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind != "file":  # a symlink (save_last="link") is Lightning's own: never touched
            return None
        m = NAME_RE.match(child.key.rsplit("/", 1)[-1])
        return int(m.group(1)) if m is not None else None

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        path = ckpt.local_path()
        return path is not None and os.path.isfile(path) and not os.path.islink(path)

    def commit_state(self, path: str, step: int | None) -> Examined:
        size = safe_load.regular_size(path)
        if size is None:
            return Examined("partial", "removed while it was being read")
        if size == 0:
            return Examined("partial", "0 bytes: Lightning's write did not finish")
        import zipfile

        if not zipfile.is_zipfile(path):
            return Examined("partial", "not a whole torch.save archive (no zip directory at its end): "
                                       "the write did not finish")
        return Examined("committed")

    def kind_of(self, rel: str) -> FileKind:
        return "torch"

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """``best_model_path`` as the newest complete file's ``ModelCheckpoint`` state records it."""
        root = self.root.local_path() if self.root is not None else None
        if root is None:
            return {}
        done = sorted((int(NAME_RE.match(n).group(1)), n) for n, s in entries  # type: ignore[union-attr]
                      if s == "committed" and NAME_RE.match(n))
        for _step, name in reversed(done):
            best = _best_model_path(os.path.join(root, name))
            if best is not None:
                return {os.path.basename(best): f"ModelCheckpoint's best_model_path (in {name})"}
        return {}

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"trainer.fit(model, ckpt_path={ckpt_path!r})")


def _best_model_path(path: str) -> str | None:
    """Read the checkpoint's callback states (weights_only, tensors memory-mapped)."""
    import pickle

    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError):
        return None
    callbacks = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    for key, state in (callbacks or {}).items():
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict):
            best = state.get("best_model_path")
            if isinstance(best, str) and best:
                return best
    return None
