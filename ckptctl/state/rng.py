"""Random number generator states of this process: Python, NumPy, torch CPU and CUDA.

Stored per rank as JSON (no pickle): torch's byte-tensor states as base64, NumPy's key array
as a list. Restoring them makes a resumed run draw the same numbers as one that never stopped.

Restoring is two steps so that a load is all-or-nothing: ``decode`` turns the saved JSON into
states each generator has already accepted (tried on a fresh generator of its kind, never on
the process's own), raising ``InvalidCheckpoint`` for anything malformed; ``RngState.apply``
then sets them, and cannot fail on the checkpoint's account.
"""

from __future__ import annotations

import base64
import binascii
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptctl.errors import InvalidCheckpoint


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(s: Any) -> torch.Tensor:
    if not isinstance(s, str):
        raise TypeError(f"expected base64 text, got {type(s).__name__}")
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def get_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


@dataclass(frozen=True)
class RngState:
    """Decoded generator states, each already accepted by a generator of its kind."""

    python: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    def apply(self) -> None:
        """Set this process's generators."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None and torch.cuda.is_available() and len(self.cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(self.cuda)
        # A different GPU count on resume: per-device states cannot be mapped; keep the fresh ones.


def decode(state: Any, where: str) -> RngState:
    """The saved JSON ``state`` as an ``RngState``; ``InvalidCheckpoint`` naming ``where`` (the
    file and rank it came from) when any part of it is malformed."""
    try:
        p, n = state["python"], state["numpy"]
        py = (p["version"], tuple(p["state"]), p["gauss"])
        random.Random().setstate(py)  # a fresh generator validates; the process's is untouched
        keys = np.array(n["keys"], dtype=np.uint32)
        npy = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached"])
        np.random.RandomState().set_state(npy)
        cpu = _tensor(state["torch"])
        torch.Generator().set_state(cpu)
        cuda = None
        if "cuda" in state:
            if not isinstance(state["cuda"], list):
                raise TypeError("cuda states are not a list")
            cuda = [_tensor(s) for s in state["cuda"]]
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, binascii.Error, RuntimeError) as e:
        # RuntimeError: torch's refusal of a generator state of the wrong size.
        raise InvalidCheckpoint(
            f"{where}: saved RNG state is malformed ({type(e).__name__}: {e})",
            hint="the checkpoint is corrupt or was written by a broken writer; resume from an older checkpoint",
        ) from None
    return RngState(py, npy, cpu, cuda)


def set_state(state: dict[str, Any]) -> None:
    """Decode and apply ``state`` (see ``decode``)."""
    decode(state, "RNG state").apply()
