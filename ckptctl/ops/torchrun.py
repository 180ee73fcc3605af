"""Running a verb as a job under torchrun: join the job's process group for the verb's duration.

``ckptctl reshard`` started by ``torchrun --nproc-per-node N`` splits the target shards among
the N processes. The group is gloo (CPU tensors only: nothing here needs a GPU) and is set up
from torchrun's environment (MASTER_ADDR, RANK, WORLD_SIZE...).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def torchrun_group() -> Iterator[int]:
    """Under torchrun (WORLD_SIZE > 1), join a gloo group unless one is already initialised,
    and leave it afterwards; yields this process's rank (0 when run plainly)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield 0
        return
    import torch.distributed as dist  # only under torchrun: plain runs never import it

    if dist.is_initialized():
        yield dist.get_rank()
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()
