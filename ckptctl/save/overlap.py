"""The opt-in overlap of a save's copies with the next forward/backward
(``Checkpointer(..., overlap_copies=True)``): which copies may finish late, the events that mark
their end, and the optimizer step pre-hooks that wait for them on the GPU.

Opt-in and not measured on a GPU yet. A parameter, or an optimizer's state tensor, changes only
in that optimizer's ``step()``, so its copy may run while the next forward/backward does;
``step()`` first waits for it (a one-shot step pre-hook that makes each device's current stream
wait for the copies' event: no host stall). Everything else (module buffers such as BatchNorm's
running statistics, which forward changes; tensors of other keys; parameters no optimizer in
the state steps) is copied before ``save()`` returns. The writer waits for the event before it
hashes. Not covered: code that writes parameters in place outside ``step()`` (an EMA copied
into the weights, ``p.data.copy_`` by hand) before the next step; such jobs keep the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ckptctl.state.placement import SavedTensor
from ckptctl.state.roles import role_of


@dataclass
class CopyFence:
    """The end of the copies a snapshot left in flight: one event per source device."""

    events: dict[int, "torch.cuda.Event"]

    def hold_streams(self) -> None:
        """Make each device's *current* stream (the caller's) wait for the copies, without
        blocking the host: kernels queued after this run after the copies have read."""
        for index, event in self.events.items():
            torch.cuda.current_stream(index).wait_event(event)

    def synchronize(self) -> None:
        """Block until every copy has landed in host memory."""
        for event in self.events.values():
            event.synchronize()


def overlap_plan(state: Mapping[str, Any], tensors: Mapping[str, SavedTensor]) -> tuple[frozenset[str], list[Any]]:
    """(names of the GPU tensors whose copies may be deferred, the optimizers whose ``step()``
    must wait for them)."""
    names = frozenset(n for n in stepped_by_optimizers(state, tensors) if tensors[n].data.device.type == "cuda")
    return names, [v for v in state.values() if role_of(v) == "optimizer"] if names else []


def stepped_by_optimizers(state: Mapping[str, Any], tensors: Mapping[str, SavedTensor]) -> frozenset[str]:
    """The names of the model and optimizer tensors that only an optimizer of ``state``
    changes: its parameters and its state tensors. A tensor counts as one of them when it
    shares storage with one (the state dict helpers return detached views of the parameters,
    DTensors their local shards). Module buffers, tensors of other keys, and parameters no
    optimizer of the state steps are not."""
    owned: set[int] = set()
    for opt in (v for v in state.values() if role_of(v) == "optimizer"):
        for group in opt.param_groups:
            for p in group["params"]:
                owned.add(_storage_ptr(p))
        for per_param in opt.state.values():
            for v in per_param.values() if isinstance(per_param, dict) else ():
                if isinstance(v, torch.Tensor):
                    owned.add(_storage_ptr(v))
    owned.discard(0)  # empty tensors have no memory: they match nothing
    return frozenset(n for n, t in tensors.items() if t.group in ("model", "optimizer") and _storage_ptr(t.data) in owned)


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)  # a DTensor parameter: its local shard's memory
    return (local if isinstance(local, torch.Tensor) else t).untyped_storage().data_ptr()


def hold_steps(optimizers: list[Any], fence: CopyFence) -> list[Any]:
    """Register on each optimizer a one-shot step pre-hook that holds its next step behind
    ``fence``; returns the hooks' handles, which the caller removes (at the next save, or on
    close): a hook cannot remove itself, because torch iterates over the hook dict while it
    calls them."""
    handles: list[Any] = []
    for opt in optimizers:
        fired = [False]

        def hook(_opt: Any, _args: Any, _kwargs: Any, fired: list[bool] = fired) -> None:
            if not fired[0]:  # one-shot: later steps do not wait on this save
                fired[0] = True
                fence.hold_streams()

        handles.append(opt.register_step_pre_hook(hook))
    return handles
