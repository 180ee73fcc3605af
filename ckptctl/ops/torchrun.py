"""Running a verb as a job under torchrun: join the job's process group for the verb's duration.

``ckptctl reshard`` started by ``torchrun --nproc-per-node N`` splits the target shards among
the N processes; ``verify``, ``cp`` and ``restore`` split their files (``torchrun_job``, with
``ops.distributed``). The group is gloo (CPU tensors only: nothing here needs a GPU) and is set
up from torchrun's environment (MASTER_ADDR, RANK, WORLD_SIZE...).
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from datetime import timedelta
from typing import Iterator

from ckptctl.errors import CkptError
from ckptctl.ops.distributed import Job, joined, speaks


# How long a rank waits in a collective for the others: a verb's work may be one rank's alone
# for hours (``cp`` of terabytes by rank 0, a node leader's commit), and gloo's default (30 min)
# would fail the waiting ranks as "a rank left". A rank that dies is noticed sooner: torchrun
# ends the whole job when one of its processes exits.
GROUP_TIMEOUT = timedelta(hours=24)


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
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    token = _verb_run.set(True)  # the group is this verb's: every rank runs it
    try:
        yield dist.get_rank()
    finally:
        _verb_run.reset(token)
        dist.destroy_process_group()


# Whether every rank of the process group runs this verb: set where the verb joined the group
# itself, or by the command line (``torchrun_session``). A library caller whose group exists
# for training (and may call a verb on rank 0 alone) never gets its work split: the other ranks
# would never join the collectives.
_verb_run: ContextVar[bool] = ContextVar("ckptctl_verb_run", default=False)


@contextlib.contextmanager
def torchrun_job() -> Iterator[Job | None]:
    """``torchrun_group``, with the verb's work split over its ranks (``ops.distributed.joined``)
    when every rank runs the verb (see ``_verb_run``): yields the Job, or None for a plain run
    (which behaves exactly as without torchrun) and for a process group the verb did not join."""
    with torchrun_group():
        if not _verb_run.get():
            yield None
            return
        with joined() as job:
            yield job


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job of more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextlib.contextmanager
def torchrun_session() -> Iterator[bool]:
    """A command's whole run under torchrun, printing included: the group is joined for it,
    and yields whether this rank speaks for the job (``ops.distributed.speaks``). On the way
    out every rank waits for the others, so that rank 0 has printed the job's result (or its
    error) before any rank exits: torchrun stops the remaining ranks as soon as one exits with
    an error, which would otherwise cut rank 0 off before it said why. A plain run: True.

    Only after the command ended or failed with a CkptError (which the ranks agree on): any
    other exception (a bug, an interrupt) happened on this rank alone, while the others may be
    waiting in another collective; it ends the process, and torchrun the job."""
    with torchrun_group():
        token = _verb_run.set(under_torchrun())  # the command line runs on every rank of the job
        try:
            yield speaks()
        except CkptError:
            _last_barrier()
            raise
        else:
            _last_barrier()
        finally:
            _verb_run.reset(token)


def _last_barrier() -> None:
    if not under_torchrun():
        return
    import torch.distributed as dist

    try:
        dist.barrier()
    except RuntimeError:  # a rank died: the others exit anyway, with the error already agreed on
        pass
