"""A Hugging Face ``Trainer`` checkpoint (``checkpoint-N``) read as one state: the model's
safetensors plus the training state the Trainer keeps beside it.

What ``transformers`` writes there (``Trainer._save_checkpoint`` in ``transformers/trainer.py``):
``model.safetensors`` (or shards + ``model.safetensors.index.json``), ``optimizer.pt``
(``torch.save(optimizer.state_dict())``), ``scheduler.pt`` (``lr_scheduler.state_dict()``),
``scaler.pt`` (``GradScaler.state_dict()``, mixed precision only), ``rng_state.pth`` /
``rng_state_R.pth`` (python, numpy, torch and CUDA generator states), ``training_args.bin``
(``torch.save(TrainingArguments)``) and, written last, ``trainer_state.json``.

The state this source hands over, nested by top-level key:

- ``model``: every tensor of the safetensors, as ``model/<its HF name>``;
- ``optimizer``, ``scheduler``, ``scaler``: the files' contents as torch saved them (the
  optimizer state keyed by parameter index, as ``optimizer.load_state_dict`` expects);
- ``rng_state``: only when it loads with ``weights_only=True`` (numpy's state usually needs
  pickle: then it is listed as dropped, with the reason);
- ``trainer_state``: ``trainer_state.json`` as it is (its ``global_step`` is the step).

Every ``.pt``/``.pth`` file is read with ``torch.load(weights_only=True)`` only (``TorchSource``);
one that does not load that way is listed in ``dropped`` with the reason, never silently left
out. ``training_args.bin`` is a pickle of a class: never loaded, listed as dropped.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ckptctl.errors import InvalidCheckpoint, StateError, UsageError
from ckptctl.format import parse
from ckptctl.interop.base import Source, TensorMeta, group_of, rename_refs
from ckptctl.interop.safetensors_io import SafetensorsSource
from ckptctl.interop.steps import StepClue, as_step
from ckptctl.interop.torch_io import NeedsPickle, NotPlainFile, TorchSource
from ckptctl.state import tree as statetree
from ckptctl.storage import open_storage

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
# File -> top-level key of the state it is carried under, in the order the Trainer saves them.
CARRIED = (("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler"), ("scaler.pt", "scaler"))
RNG_FILE = re.compile(r"^rng_state(_\d+)?\.pth$")
TRAINER_FILES = (TRAINER_STATE, TRAINING_ARGS, *(f for f, _ in CARRIED))
MAX_TRAINER_STATE_BYTES = 256 << 20  # log_history grows with the run; far above a real one


def is_trainer_checkpoint(path: str) -> bool:
    """A directory holding the Trainer's own files beside the model (not a bare model export)."""
    return os.path.isdir(path) and any(os.path.lexists(os.path.join(path, f)) for f in TRAINER_FILES)


class HfTrainerSource(Source):
    kind = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.url = path
        self.storage = open_storage(path)
        self._parts: list[Source] = []
        self._route: dict[str, tuple[Source, str]] = {}  # our name -> (part, its name there)
        self.carried: list[str] = []  # "optimizer.pt as optimizer/": what came along besides the model
        state = self._trainer_state()
        model = SafetensorsSource(path)
        self._parts.append(model)
        self.metadata = dict(model.metadata)
        self.dropped.extend(model.dropped)
        tree: dict[str, Any] = {"model": self._adopt(model, "model")}
        names = sorted(i.key for i in self.storage.children())
        for fname, key in CARRIED + tuple((n, "rng_state" if n == "rng_state.pth" else n[:-4]) for n in names if RNG_FILE.match(n)):
            if fname in names:
                part = self._load_part(fname)
                if part is not None:
                    tree[key] = self._adopt(part, key)
                    self.carried.append(f"{fname} as {key}/")
        if TRAINING_ARGS in names:
            self.skipped.append(f"{TRAINING_ARGS}: a pickle of transformers.TrainingArguments (a class); "
                                "never unpickled, so not carried")
        if state is not None:
            try:
                tree["trainer_state"] = statetree.encode(state, ("trainer_state",), lambda n, t: None)
                self.carried.append(f"{TRAINER_STATE} as trainer_state")
            except StateError as e:
                self.dropped.append(f"{TRAINER_STATE}: {e}")
        self.tree = tree

    def _trainer_state(self) -> dict | None:
        """``trainer_state.json``, parsed by the bounded parser; its ``global_step`` is a step clue.
        The Trainer writes it last, so a checkpoint without it is a save that did not finish."""
        where = self.storage.url_of(TRAINER_STATE)
        info = self.storage.stat(TRAINER_STATE)
        if info is None:
            raise InvalidCheckpoint(f"{self.url}: no {TRAINER_STATE}, which the Trainer writes last: this save did not finish",
                                    hint="use the previous checkpoint-N (`ckptctl latest ROOT` names the newest complete one)")
        doc = parse.load_json(self.storage.read(TRAINER_STATE, max_size=MAX_TRAINER_STATE_BYTES), where, TRAINER_STATE,
                              max_bytes=MAX_TRAINER_STATE_BYTES, allow_nonfinite=True)
        if not isinstance(doc, dict):
            raise InvalidCheckpoint(f"{where}: {TRAINER_STATE} is not a JSON object", hint="the file was altered or truncated")
        step = as_step(doc.get("global_step"))
        if step is None:
            raise InvalidCheckpoint(f"{where}: global_step is {parse.show(doc.get('global_step'))}, not a step",
                                    hint="the file was altered; pass --step N if you know the step")
        self.step_clues.append(StepClue(step, f"{TRAINER_STATE} global_step"))
        return doc

    def _load_part(self, fname: str) -> Source | None:
        """``fname`` through TorchSource (weights_only), or None with the reason in ``dropped``."""
        try:
            part = TorchSource(os.path.join(self.url, fname))  # opened without blocking or following a link
        except NeedsPickle as e:  # intact, but holds more than weights_only builds (numpy's RNG state)
            if not e.classes:
                self.dropped.append(f"{fname}: not carried: {e}")
                return None
            self.skipped.append(f"{fname}: not carried: it holds pickled {', '.join(e.classes[:4])}, which are "
                                "never unpickled")
            return None
        except NotPlainFile:
            raise  # a FIFO or link planted in the checkpoint: the checkpoint is not to be trusted
        except InvalidCheckpoint as e:
            self.dropped.append(f"{fname}: not carried: {e}")
            return None
        except UsageError as e:  # values JSON cannot hold
            self.dropped.append(f"{fname}: not carried: {e}")
            return None
        self._parts.append(part)
        self.dropped.extend(f"{fname}: {d}" for d in part.dropped)
        return part

    def _adopt(self, part: Source, key: str) -> Any:
        """Take ``part``'s tensors under ``key/``; returns its tree with the references renamed."""
        def ours(name: str) -> str:
            return statetree.join((key,)) + "/" + name if part.tree is not None else statetree.join((key, name))

        for name, m in part.tensors.items():
            new = ours(name)
            self.tensors[new] = TensorMeta(new, m.dtype, m.shape, group_of(new) if key != "model" else "model")
            self._route[new] = (part, name)
        if part.tree is not None:
            return rename_refs(part.tree, ours)
        return {name: {statetree.TENSOR: ours(name)} for name in part.tensors}

    def read_into(self, name: str, out: torch.Tensor) -> None:
        part, inner = self._route[name]
        part.read_into(inner, out)

    def close(self) -> None:
        for p in self._parts:
            p.close()
