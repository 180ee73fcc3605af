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
for this layout only. ``last.ckpt`` has no step in its name: it is an alias
(``layouts.aliases``), a copy of the newest save that ``ModelCheckpoint`` rewrites at every
save, shown by ``ls`` with the step it records and never a checkpoint of its own, so prune
never deletes it nor counts it as a step. The ``best_model_path`` that ``ModelCheckpoint``
records inside the newest complete file is protected by prune as Lightning's own
``save_top_k`` keeps it: the best of
*every* ``ModelCheckpoint`` callback (one per monitored metric), and its ``last_model_path``
(what ``ckpt_path="last"`` resumes from). Files that record no callback
state say nothing and the next older one is read; when the newest file that does cannot be
read safely (a class beyond the allow-list in ``hyper_parameters``, a damaged file) or its
``callbacks`` is not the dict of states Lightning writes, the best is unknown and every
complete file that might be it is kept, and the plan says why (never assumed absent).

Files are test-loaded with ``torch.load(weights_only=True)``, allowing ``pathlib``'s pure and
POSIX paths (``save_hyperparameters()`` keeps a ``Path`` argument as one; building one runs no
code of the file); anything else a LightningModule puts in ``hyper_parameters`` is reported as
not test-loaded, never unpickled.
Resumable or export (``kind_of_checkpoint``): ``Trainer.save_checkpoint`` (and so
``ModelCheckpoint``) writes ``optimizer_states`` unless ``save_weights_only=True``, which keeps
the weights, epoch and step only; ``fit(ckpt_path=...)`` of such a file restarts the optimizer.
So a file whose top-level dict (read with ``torch.load(weights_only=True)``, tensors mapped,
not read) has ``optimizer_states`` is resumable, one without it an export; a file that cannot
be read safely says nothing and counts as resumable (verify judges it).
Weakness: sharded strategies (FSDP, DeepSpeed) write a ``*.ckpt`` *directory* instead; those
are not read here yet (not listed, so never deleted).
"""

from __future__ import annotations

import pathlib
import posixpath
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Iterable

from ckptctl.interop.steps import as_step
from ckptctl.layouts import safe_load
from ckptctl.layouts.aliases import Alias
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.file_check import FileKind
from ckptctl.layouts.stack import StackLayout, top_level, top_level_keys, undetermined, whole_torch_file
from ckptctl.format.manifest import Manifest
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import local_copy, open_file

# Building a pure or POSIX path runs no code of the file (``WindowsPath`` raises on POSIX,
# so it stays out and such a file is reported as not test-loaded).
PATHS: tuple[type, ...] = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
NAME_RE = re.compile(r"(?:.*[^0-9A-Za-z])?step=([0-9]{1,18})(?:[^0-9].*)?\.ckpt\Z", re.ASCII)
LAST = re.compile(r"last(-v[0-9]{1,9})?\.ckpt\Z", re.ASCII)  # ModelCheckpoint.CHECKPOINT_NAME_LAST, versioned


class LightningLayout(StackLayout):
    name = "lightning"
    title = "Lightning"
    pattern = NAME_RE
    files_are_checkpoints = True
    seal_note = "a checkpoint that is one file (Lightning's *.ckpt) has no directory to hold a seal"

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind != "file":  # a symlink (save_last="link") is Lightning's own: never touched
            return None
        m = NAME_RE.match(child.key.rsplit("/", 1)[-1])
        return int(m.group(1)) if m is not None else None

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        return safe_load.regular_size(ckpt, "") is not None  # never a link, a FIFO or a directory

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        return whole_torch_file(ckpt, "Lightning's write did not finish")

    def kind_of(self, rel: str) -> FileKind:
        return "torch"

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return PATHS

    def aliases(self) -> list[Alias]:
        """``last.ckpt`` (``last-vN.ckpt`` beside an older one): ``save_last=True`` rewrites it
        with every save as a copy of the newest, ``save_last="link"`` makes it a symlink
        (never followed). Its step is the ``global_step`` it records, read as ``top_level``
        reads (tensors not read; not downloaded when large on object storage)."""
        root = self.root
        if root is None:
            return []
        children = root.children()
        steps = {self.step_of(c): c.key for c in children}
        out = []
        for c in children:
            if not LAST.match(c.key) or c.kind not in ("file", "link"):
                continue
            if c.kind == "link":
                out.append(Alias(c.key, root.url_of(c.key), self.name, None, None,
                                 "ModelCheckpoint(save_last=\"link\")'s link to its newest save (never followed)"))
                continue
            doc = top_level(root, c.key, PATHS)
            step = None if isinstance(doc, str) else as_step(doc.get("global_step"))
            out.append(Alias(c.key, root.url_of(c.key), self.name, step, steps.get(step) if step is not None else None,
                             "ModelCheckpoint(save_last=True)'s copy of its newest save, rewritten at every save"))
        return out

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Every ``ModelCheckpoint``'s ``best_model_path`` and ``last_model_path`` as the newest
        complete file that records callback states has them; when that file cannot be read
        safely or understood, every complete or broken file (any of them may be the best)."""
        root = self.root
        if root is None:
            return {}
        entries = list(entries)
        # A broken file is read too: one the load level could not decode (a class outside the
        # allow-list) may still be what Lightning resumes from, and its best is then unknown.
        done = sorted((int(m.group(1)), n) for n, s in entries
                      if s in ("committed", "broken") and (m := NAME_RE.match(n)))
        for _step, name in reversed(done):
            found = best_paths(root, name)
            if isinstance(found, Unknown):
                why = f"ModelCheckpoint's best_model_path is unknown: {name} {found.why}; kept for safety"
                return {n: why for n, s in entries if s in ("committed", "broken")}
            if found:
                out: dict[str, str] = {}
                for path, field in found:  # a best first: its reason wins when a path is both
                    out.setdefault(posixpath.basename(path), f"ModelCheckpoint's {field} (in {name})")
                return out
        return {}

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        keys = top_level_keys(ckpt, "", PATHS)
        if isinstance(keys, str):
            return undetermined(keys.strip() or "the file could not be read safely")
        if "optimizer_states" in keys:
            return CheckpointKind("resumable", "holds optimizer_states")
        return CheckpointKind("export", "no optimizer_states: weights only (save_weights_only=True)")

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"trainer.fit(model, ckpt_path={ckpt_path!r})", ("--ckpt_path", ckpt_path))


@dataclass(frozen=True)
class Unknown:
    """A file whose callback states could not be read safely or understood."""

    why: str  # completes "<file> ...": what stood in the way


def best_paths(root: Storage, name: str) -> list[tuple[str, str]] | Unknown:
    """(path, field) of the ``best_model_path`` of every ``ModelCheckpoint`` state the
    Lightning checkpoint ``name`` under ``root`` records, then of each ``last_model_path`` (what
    ``ckpt_path="last"`` resumes from, when its name has a step); ``[]`` when it records no
    callback state at all. ``Unknown`` when it cannot be read with
    ``torch.load(weights_only=True)`` or its ``callbacks`` is not the dict of states Lightning
    writes. Read with tensors memory-mapped, never unpickled."""
    import torch

    f = open_file(root, name)
    if f is None:
        return Unknown("is not a plain file any more")
    try:
        with f, local_copy(f) as where, torch.serialization.safe_globals(list(PATHS)):
            ckpt = torch.load(where, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        text = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in text if "GLOBAL" in ln or "Unsupported" in ln), text[0] if text else "")
        return Unknown(f"cannot be read safely (it needs pickle beyond plain values: {detail[:160]})")
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, RecursionError) as e:  # a damaged or hostile file
        first = str(e).strip().splitlines()
        return Unknown(f"does not load ({(first[0] if first else type(e).__name__)[:160]})")
    if not isinstance(ckpt, dict):
        return Unknown(f"holds a {type(ckpt).__name__}, not the dict Lightning saves")
    callbacks = ckpt.get("callbacks")
    if callbacks is None:
        return []  # saved without callback states (Trainer.save_checkpoint of a model only)
    if not isinstance(callbacks, dict):
        return Unknown(f"has `callbacks` of type {type(callbacks).__name__}, not Lightning's dict of callback states")
    best: list[tuple[str, str]] = []
    last: list[tuple[str, str]] = []
    for key, state in callbacks.items():
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint")):
            continue  # other callbacks' states (EarlyStopping, ...): none of prune's business
        value = state.get("best_model_path") if isinstance(state, dict) else None
        if not isinstance(state, dict) or not isinstance(value, (str, *PATHS)):
            return Unknown(f"has a {key[:60]!r} state without a readable best_model_path")
        if str(value):
            best.append((str(value), "best_model_path"))
        value = state.get("last_model_path", "")
        if not isinstance(value, (str, *PATHS)):
            return Unknown(f"has a {key[:60]!r} state whose last_model_path is not a path")
        if str(value):
            last.append((str(value), "last_model_path"))
    return best + last
