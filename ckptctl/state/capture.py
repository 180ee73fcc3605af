"""What a training state holds, as named tensors and JSON: ``capture(state)``.

``state`` is a dict whose values each play one role (``state.roles``): ``nn.Module``s,
optimizers, stateful objects (``state_dict()``/``load_state_dict()``: LR schedulers,
``StatefulDataLoader``, grad scalers), tensors, or JSON values (nested dicts/lists of them
and of tensors).

Optimizer state is keyed by parameter *name* (torch's ``get_optimizer_state_dict``), not by
integer id, so it survives re-wrapping the model and re-sharding. Module state comes from
``get_model_state_dict`` for the same reason: DDP's ``module.`` prefix and wrapper names are
removed, so a DDP-saved checkpoint loads into an FSDP2 model and back.

Which rank writes which tensor is ``state.placement``'s; each rank's own copy of its small
non-model state is ``state.per_rank``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Imported here, not inside the functions that use them: importing torch's state_dict helpers
# takes ~0.6 s, which would otherwise land in the first save's stall.
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from ckptctl.errors import StateError
from ckptctl.state import rng, tree
from ckptctl.state.per_rank import RANK_STATE_KEY, per_rank_state
from ckptctl.state.placement import RANK0, REPLICATED, SavedTensor, saved_tensor
from ckptctl.state.roles import role_of

# The key of a rank's RNG states inside its shard header's ``rank_state``.
RNG_KEY = "rng"


@dataclass
class Captured:
    tensors: dict[str, SavedTensor] = field(default_factory=dict)
    tree: dict[str, Any] = field(default_factory=dict)  # JSON, tensors replaced by references
    rank_state: dict[str, Any] = field(default_factory=dict)  # per-rank JSON (RNG states)
    buffers: set[str] = field(default_factory=set)  # names of module buffers (BatchNorm stats...)


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


def optimizer_state_dict(opt: torch.optim.Optimizer, state: dict[str, Any], key: str, *, for_load: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name.

    An optimizer that has not stepped yet has no state. torch's helper creates it by running
    one ``step()`` with zero gradients and lr 0, which is harmless before a load (the load
    overwrites it, and the restore fills those tensors in place) but not before a save: it would
    count a step in Adam's bias correction and fire step hooks, so a checkpoint at step 0 would
    change the training. For a save, such an optimizer is named here without stepping it.
    """
    model = model_for(opt, state, key)
    if model is None:  # no model to name parameters by: fall back to torch's integer ids
        return opt.state_dict()
    if not for_load and not opt.state:
        return _unstepped_optimizer_state_dict(model, opt)
    return get_optimizer_state_dict(model, opt)


def _unstepped_optimizer_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    # The same naming as get_optimizer_state_dict: canonical module names (no DDP or compile
    # wrapper prefixes), one per parameter.
    from torch.distributed.checkpoint.state_dict import _get_fqns  # private, as torch's helper uses it

    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters():
        names[id(param)] = sorted(_get_fqns(model, name))  # several for an FSDP1 flat parameter
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [n for p in g["params"] for n in names[id(p)]]}
        for g in opt.param_groups
    ]
    return {"state": {}, "param_groups": groups}


def module_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state keyed by canonical names (no DDP ``module.`` or wrapper prefixes);
    FSDP2 parameters stay sharded DTensors sharing memory with the module's."""
    return get_model_state_dict(module)

def capture(state: dict[str, Any], *, with_rng: bool = True, per_rank: bool = False) -> Captured:
    """Named tensors and JSON for ``state``. Tensors are *not* copied here.

    ``per_rank`` (set when more than one rank saves): also keep this rank's own copy of the
    non-module, non-optimizer state in ``rank_state["state"]`` (see ``per_rank_state``).
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    out = Captured()

    def add(group: str, shared_writer: str, buffer_ptrs: frozenset[int] = frozenset()):
        def on_tensor(name: str, t: torch.Tensor) -> None:
            if name in out.tensors:
                raise StateError(f"tensor name {name!r} appears twice in the state")
            tree.check_savable(name, t)
            out.tensors[name] = saved_tensor(t, group, shared_writer)
            if buffer_ptrs and t.data_ptr() in buffer_ptrs:
                out.buffers.add(name)
        return on_tensor

    own: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or key.startswith("_"):
            raise StateError(f"state key {key!r}: top-level keys must be non-empty strings not starting with '_'")
        role = role_of(value)
        if role == "module":
            # Buffers are told apart by their memory: the state dict's tensors are new views of it.
            buffer_ptrs = frozenset(b.data_ptr() for b in value.buffers() if b.numel())
            out.tree[key] = tree.encode(module_state_dict(value), (key,), add("model", REPLICATED, buffer_ptrs))
        elif role == "optimizer":
            out.tree[key] = tree.encode(optimizer_state_dict(value, state, key), (key,), add("optimizer", REPLICATED))
        elif role == "tensor":
            out.tree[key] = tree.encode(value, (key,), add("other", REPLICATED))
        else:
            raw = value.state_dict() if role == "stateful" else value
            out.tree[key] = tree.encode(raw, (key,), add("other", RANK0))
            if per_rank:
                own[key] = raw
    if per_rank and own:
        out.rank_state[RANK_STATE_KEY] = per_rank_state(own)
    if with_rng:
        out.rank_state[RNG_KEY] = rng.get_state()
    return out
