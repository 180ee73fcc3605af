"""This process's rank and the world size: torch.distributed's when initialised, else 0 and 1."""

from __future__ import annotations

import torch.distributed as dist


def current_rank(group: "dist.ProcessGroup | None" = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: "dist.ProcessGroup | None" = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
