"""The role each value of a training state plays, which decides how it is saved and restored.

A state is a dict; each value is one of:

- ``"module"``: an ``nn.Module``. Its tensors are saved by canonical name and restored in place.
- ``"optimizer"``: a ``torch.optim.Optimizer``. Its state is keyed by parameter name through
  the module in the same state that owns its parameters, so it survives re-sharding.
- ``"tensor"``: a tensor, restored in place.
- ``"stateful"``: anything that follows the ``Stateful`` protocol below (the same protocol as
  ``torch.distributed.checkpoint.stateful.Stateful``): LR schedulers, ``StatefulDataLoader``,
  grad scalers, your own classes. ``state_dict()`` is saved; ``load_state_dict()`` restores.
- ``"value"``: plain JSON values, and dicts/lists of them and of tensors.

Roles are found by type first: a class registered with ``register_role`` gets its role
whatever methods it has, so a class is never guessed wrong by the shape of its methods.

    >>> from ckptctl.state.roles import register_role
    >>> class Counter:                                  # doctest: +SKIP
    ...     def state_dict(self): ...
    ...     def load_state_dict(self, sd): ...
    >>> register_role(Counter, "stateful")              # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from ckptctl.errors import UsageError

Role = Literal["module", "optimizer", "tensor", "stateful", "value"]
ROLES: tuple[Role, ...] = ("module", "optimizer", "tensor", "stateful", "value")


@runtime_checkable
class Stateful(Protocol):
    """An object that can hand out its state and take it back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


_registered: dict[type, Role] = {}


def register_role(cls: type, role: Role) -> None:
    """Give every instance of ``cls`` (and of its subclasses) ``role``, ahead of the built-in
    rules. Registering ``"stateful"`` for a class without ``state_dict``/``load_state_dict``
    is refused."""
    if role not in ROLES:
        raise UsageError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if role == "stateful" and not (callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None))):
        raise UsageError(
            f"{cls.__name__} cannot be registered as stateful: it lacks state_dict() or load_state_dict()",
            hint="implement the Stateful protocol (ckptctl.state.roles.Stateful)",
        )
    _registered[cls] = role


def role_of(value: Any) -> Role:
    """How ``value`` is captured and restored (see the module docstring)."""
    for cls in type(value).__mro__:
        role = _registered.get(cls)
        if role is not None:
            return role
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Stateful):
        return "stateful"
    return "value"
