"""An Accelerate ``save_state`` directory (``checkpoint_N``) read as one state: the model's
safetensors plus the training state ``save_accelerator_state`` writes beside it
(accelerate/checkpointing.py).

- ``model``: every tensor of ``model.safetensors`` (and ``model_1.safetensors``, ...);
- ``optimizer``, ``scheduler`` (``optimizer_1``, ...), ``sampler``, ``dl_state_dict``,
  ``scaler``: the ``torch.save`` files as torch saved them, when they load with
  ``weights_only=True`` (``TorchSource``);
- ``random_states_R.pkl`` (python, numpy and torch RNG state per process) and
  ``custom_checkpoint_I.pkl``: numpy's RNG state and user objects need pickle beyond what
  ``weights_only`` builds, so they are listed in ``dropped`` with the reason, never unpickled.

Nothing is left out silently: every file the directory holds besides the model is either
carried (``carried``) or named in ``dropped``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptctl.errors import InvalidCheckpoint
from ckptctl.interop.base import Source
from ckptctl.interop.hf_trainer_io import HfTrainerSource
from ckptctl.interop.safetensors_io import SafetensorsSource
from ckptctl.storage import open_storage

# File -> top-level key of the state it is carried under (accelerate/utils/constants.py names).
STATE_FILE = re.compile(r"^(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin$|^scaler\.pt$")
PICKLED = re.compile(r"^(random_states_\d+|custom_checkpoint_\d+)\.pkl$")
RNG0 = "random_states_0.pkl"  # written last by the main process: without it the save did not finish


def is_accelerate_checkpoint(path: str) -> bool:
    """A local directory holding ``save_state``'s own files beside the model (and none of the
    Trainer's, whose checkpoints hold accelerate-named files under FSDP)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return (any(STATE_FILE.match(n) or PICKLED.match(n) for n in names)
            and "trainer_state.json" not in names and "training_args.bin" not in names)


class AccelerateSource(HfTrainerSource):
    """Shares the Trainer source's way of carrying ``torch.save`` parts (``_load_part``,
    ``_adopt``, ``read_into``); only the files differ."""

    kind = "safetensors"

    def __init__(self, path: str) -> None:
        Source.__init__(self)  # not the Trainer's __init__: there is no trainer_state.json here
        self.url = path
        self.storage = open_storage(path)
        self._parts: list[Source] = []
        self._route: dict[str, tuple[Source, str]] = {}
        self.carried: list[str] = []
        names = sorted(i.key for i in self.storage.children())
        if RNG0 not in names:
            raise InvalidCheckpoint(f"{path}: no {RNG0}, which accelerate's save_state writes after the model, "
                                    "optimizer and scheduler: this save did not finish",
                                    hint="use the previous checkpoint_N (`ckptctl latest ROOT` names the newest complete one)")
        model = SafetensorsSource(path)
        self._parts.append(model)
        self.metadata = dict(model.metadata)
        self.dropped.extend(model.dropped)
        tree: dict[str, Any] = {"model": self._adopt(model, "model")}
        for fname in names:
            if STATE_FILE.match(fname):
                key = fname.rsplit(".", 1)[0]
                part = self._load_part(fname)
                if part is not None:
                    tree[key] = self._adopt(part, key)
                    self.carried.append(f"{fname} as {key}/")
            elif PICKLED.match(fname):
                self.dropped.append(f"{fname}: not carried: accelerate pickles RNG state (numpy's) and custom "
                                    "objects, which are never unpickled")
        self.tree = tree
