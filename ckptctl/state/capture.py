"""What a training state holds, as named tensors and JSON.

``state`` is a dict whose values may be ``nn.Module``s, optimizers, any object with
``state_dict()``/``load_state_dict()`` (LR schedulers, ``StatefulDataLoader``, grad scalers),
tensors, nested dicts/lists of tensors and JSON values, or JSON values.

Optimizer state is keyed by parameter *name* (torch's ``get_optimizer_state_dict``), not by
integer id, so it survives re-wrapping the model and re-sharding. Module state comes from
``get_model_state_dict`` for the same reason: DDP's ``module.`` prefix and wrapper names are
removed, so a DDP-saved checkpoint loads into an FSDP2 model and back.

Across ranks (see ``SavedTensor.kind``):

- a DTensor (FSDP2 ``fully_shard``, tensor parallel) is saved as its local shard plus the
  shard's offsets in the global tensor; an empty local shard (uneven ``torch.chunk`` sharding)
  is not saved; of several replicas of one shard (HSDP), only the first on each replicated
  mesh dimension saves it;
- a plain tensor of a module or optimizer, or a fully replicated DTensor, is assumed to be the
  same on every rank (DDP) and is written once, by the rank the plan assigns it to;
- tensors of the other keys (data loader, scheduler, ``extra``...) are written by rank 0 only,
  so the checkpoint's shared copy of that state is one rank's consistent snapshot. Because such
  state may differ between ranks, each rank also keeps its own copy in its shard header
  (``rank_state["state"]``, see ``per_rank_state``), which loading prefers.
"""

from __future__ import annotations

import base64
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Imported here, not inside the functions that use them: importing torch's state_dict helpers
# takes ~0.6 s, which would otherwise land in the first save's stall.
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckptctl.errors import StateError
from ckptctl.state import rng, tree

log = logging.getLogger("ckptctl")

RNG_KEY = "rng"


# Who writes a tensor (SavedTensor.kind): each rank its own piece, one rank chosen by size
# balancing, rank 0 only, or nobody here (empty shard, or another replica writes it).
LOCAL, REPLICATED, RANK0, NONE = "local", "replicated", "rank0", "none"

# Per-rank copies of small state live in the shard header as JSON; a header is bounded (see
# format.shard.MAX_HEADER_BYTES), so the tensors kept per rank are bounded too.
MAX_PER_RANK_TENSOR_BYTES = 4 << 20


@dataclass(frozen=True)
class SavedTensor:
    """A tensor to save: the local data and where it sits in the global tensor."""

    data: torch.Tensor  # this rank's local piece (the whole tensor when not sharded)
    group: str  # "model", "optimizer" or "other"
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    kind: str = LOCAL  # LOCAL, REPLICATED, RANK0 or NONE (see above)


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


def saved_tensor(t: torch.Tensor, group: str, shared_kind: str) -> SavedTensor:
    """How one tensor is saved from this rank. ``shared_kind`` applies to tensors every rank
    holds whole (REPLICATED or RANK0); DTensors are saved by their placements."""
    if not isinstance(t, DTensor):
        t = t.detach()
        return SavedTensor(t, group, tuple(t.shape), tuple(0 for _ in t.shape), shared_kind)
    # Detaching the local shard, not the DTensor: the same memory, without a DTensor dispatch
    # per tensor on the training thread (thousands of tensors per save).
    local = _local_of(t).detach()
    shape, placements = tuple(t.shape), tuple(t.placements)
    offsets, first_replica, replicated = _placement(shape, t.device_mesh, placements)
    if replicated:
        return SavedTensor(local, group, shape, offsets, shared_kind)
    kind = LOCAL if first_replica and local.numel() > 0 else NONE
    return SavedTensor(local, group, shape, offsets, kind)


def _local_of(t: DTensor) -> torch.Tensor:
    # ``to_local()`` is an autograd Function (~8 us per call), which buys nothing here: the
    # result is detached. The DTensor's own local tensor is the same memory. Private, so only
    # used where torch still has it.
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


@functools.lru_cache(maxsize=1 << 16)
def _placement(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple[tuple[int, ...], bool, bool]:
    """(global offsets of this rank's shard, whether this rank holds the first replica of it,
    whether the tensor is fully replicated). Cached: the same for every save of a structure."""
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise StateError(
            f"DTensor with placements {placements} cannot be saved: only Shard and Replicate are supported",
            hint="reduce Partial placements (e.g. dtensor.redistribute) before saving",
        )
    if all(isinstance(p, Replicate) for p in placements):
        return tuple(0 for _ in shape), True, True
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    coord = mesh.get_coordinate() or []
    # Of the replicas of this shard (HSDP's replicate dimension), the first one writes it.
    first = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    return tuple(int(o) for o in offsets), first, False


def capture(state: dict[str, Any], *, with_rng: bool = True, per_rank: bool = False) -> Captured:
    """Named tensors and JSON for ``state``. Tensors are *not* copied here.

    ``per_rank`` (set when more than one rank saves): also keep this rank's own copy of the
    non-module, non-optimizer state in ``rank_state["state"]`` (see ``per_rank_state``).
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    out = Captured()

    def add(group: str, shared_kind: str):
        def on_tensor(name: str, t: torch.Tensor) -> None:
            if name in out.tensors:
                raise StateError(f"tensor name {name!r} appears twice in the state")
            out.tensors[name] = saved_tensor(t, group, shared_kind)
        return on_tensor

    own: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or key.startswith("_"):
            raise StateError(f"state key {key!r}: top-level keys must be non-empty strings not starting with '_'")
        kind = kind_of(value)
        if kind == "module":
            out.tree[key] = tree.encode(module_state_dict(value), (key,), add("model", REPLICATED))
        elif kind == "optimizer":
            out.tree[key] = tree.encode(optimizer_state_dict(value, state, key), (key,), add("optimizer", REPLICATED))
        elif kind == "tensor":
            out.tree[key] = tree.encode(value, (key,), add("other", REPLICATED))
        else:
            raw = value.state_dict() if kind == "stateful" else value
            out.tree[key] = tree.encode(raw, (key,), add("other", RANK0))
            if per_rank:
                own[key] = raw
    if per_rank and own:
        out.rank_state[STATE_KEY] = per_rank_state(own)
    if with_rng:
        out.rank_state[RNG_KEY] = rng.get_state()
    return out


STATE_KEY = "state"


def per_rank_state(values: dict[str, Any]) -> dict[str, Any]:
    """JSON for one rank's own copy of ``values``: the encoded tree, and its tensors inline
    (base64, with dtype and shape) since they are small: loader positions, generator states.

    A key whose tensors are large (over ``MAX_PER_RANK_TENSOR_BYTES``) or sharded (DTensors)
    gets no per-rank copy: it is listed under ``"shared"`` and every rank loads the copy in
    the manifest (rank 0's), with a warning at save time for the large ones."""
    doc: dict[str, Any] = {}
    inline: dict[str, Any] = {}
    shared: list[str] = []
    for key, value in values.items():
        tensors: dict[str, torch.Tensor] = {}
        encoded = tree.encode(value, (key,), tensors.__setitem__)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if total > MAX_PER_RANK_TENSOR_BYTES or any(isinstance(t, DTensor) for t in tensors.values()):
            shared.append(key)
            if total > MAX_PER_RANK_TENSOR_BYTES and key not in _warned_shared:
                _warned_shared.add(key)
                log.warning(
                    "state key %r holds %d bytes of tensors, too much to keep per rank: it is saved once, "
                    "from rank 0, and every rank restores rank 0's copy", key, total,
                )
            continue
        doc[key] = encoded
        inline.update({n: _inline(t) for n, t in tensors.items()})
    return {"tree": doc, "tensors": inline, "shared": shared}


_warned_shared: set[str] = set()


def per_rank_values(doc: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``per_rank_state``: the values keyed by state key."""
    from ckptctl.format import dtypes

    def tensor(name: str) -> torch.Tensor:
        try:
            d = doc["tensors"][name]
            raw = bytearray(base64.b64decode(d["b64"]))
            return torch.frombuffer(raw, dtype=dtypes.torch_dtype(d["dtype"])).reshape(d["shape"]) if raw else torch.empty(d["shape"], dtype=dtypes.torch_dtype(d["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"per-rank state: tensor {name!r} is garbled ({e})") from None

    return {k: tree.decode(v, tensor) for k, v in doc.get("tree", {}).items()}


def _inline(t: torch.Tensor) -> dict[str, Any]:
    from ckptctl.format import dtypes

    c = t.detach().cpu().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return {"dtype": dtypes.name_of(c.dtype), "shape": list(c.shape), "b64": base64.b64encode(raw).decode()}
