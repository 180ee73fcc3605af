"""What a training state holds, as named tensors and JSON.

``state`` is a dict whose values may be ``nn.Module``s, optimizers, any object with
``state_dict()``/``load_state_dict()`` (LR schedulers, ``StatefulDataLoader``, grad scalers),
tensors, nested dicts/lists of tensors and JSON values, or JSON values.

Optimizer state is keyed by parameter *name* (torch's ``get_optimizer_state_dict``), not by
integer id, so it survives re-wrapping the model and re-sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckptctl.errors import StateError
from ckptctl.state import rng, tree

RNG_KEY = "rng"


@dataclass(frozen=True)
class SavedTensor:
    """A tensor to save: the local data and where it sits in the global tensor."""

    data: torch.Tensor  # this rank's local piece (the whole tensor when not sharded)
    group: str  # "model", "optimizer" or "other"
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class Captured:
    tensors: dict[str, SavedTensor] = field(default_factory=dict)
    tree: dict[str, Any] = field(default_factory=dict)  # JSON, tensors replaced by references
    rank_state: dict[str, Any] = field(default_factory=dict)  # per-rank JSON (RNG states)


def kind_of(value: Any) -> str:
    """How a state value is captured and restored."""
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful"
    return "value"


def model_for(optimizer: torch.optim.Optimizer, state: dict[str, Any], key: str) -> nn.Module | None:
    """The module in ``state`` that owns the optimizer's parameters, or None."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= {id(p) for p in value.parameters()}:
            return value
    if any(isinstance(v, nn.Module) for v in state.values()):
        raise StateError(
            f"state key {key!r}: no module in the state owns all of this optimizer's parameters",
            hint="put the model whose parameters the optimizer updates in the same state dict",
        )
    return None


def optimizer_state_dict(opt: torch.optim.Optimizer, state: dict[str, Any], key: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = model_for(opt, state, key)
    if model is None:  # no model to name parameters by: fall back to torch's integer ids
        return opt.state_dict()
    return get_optimizer_state_dict(model, opt)


def capture(state: dict[str, Any], *, with_rng: bool = True) -> Captured:
    """Named tensors and JSON for ``state``. Tensors are *not* copied here."""
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    out = Captured()

    def add(group: str):
        def on_tensor(name: str, t: torch.Tensor) -> None:
            if name in out.tensors:
                raise StateError(f"tensor name {name!r} appears twice in the state")
            out.tensors[name] = SavedTensor(t.detach(), group, tuple(t.shape), tuple(0 for _ in t.shape))
        return on_tensor

    for key, value in state.items():
        if not isinstance(key, str) or not key or key.startswith("_"):
            raise StateError(f"state key {key!r}: top-level keys must be non-empty strings not starting with '_'")
        kind = kind_of(value)
        if kind == "module":
            out.tree[key] = tree.encode(value.state_dict(), (key,), add("model"))
        elif kind == "optimizer":
            out.tree[key] = tree.encode(optimizer_state_dict(value, state, key), (key,), add("optimizer"))
        elif kind == "stateful":
            out.tree[key] = tree.encode(value.state_dict(), (key,), add("other"))
        else:
            out.tree[key] = tree.encode(value, (key,), add("other"))
    if with_rng:
        out.rank_state[RNG_KEY] = rng.get_state()
    return out
