"""Running a verb as a job under torchrun: agree on the command, join the job's process group
for the verb's duration, and never wait for ever on a rank that is gone.

``ckptctl reshard`` started by ``torchrun --nproc-per-node N`` splits the target shards among
the N processes; ``verify``, ``cp`` and ``restore`` split their files (``torchrun_job``, with
``ops.distributed``). The group is gloo (CPU tensors only: nothing here needs a GPU) and is set
up from torchrun's environment (MASTER_ADDR, RANK, WORLD_SIZE...). Before joining it, the
ranks agree on what they were asked to do, through the job's store (``ops.rollcall.agree``):
ranks given different commands (``cp SRC D0`` and ``cp SRC D1``, ``verify A`` and ``ls ROOT``)
stop with exit 2 before anything is read or written, and a rank that never starts the command
is named (exit 3). While the verb runs, every rank's presence is watched (``rollcall.Presence``),
so that a collective waits for a rank that is gone for ``settings.TORCHRUN_TIMEOUT_S`` at most.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import Any, Iterator

from ckptctl.errors import CoordinationError, UsageError
from ckptctl.ops.distributed import Job, joined, node_id, speaks
from ckptctl.ops.rollcall import Command, Presence, agree, current_presence, present, store_timeout


@contextlib.contextmanager
def torchrun_group(command: Command | None = None) -> Iterator[int]:
    """Under torchrun (WORLD_SIZE > 1), join a gloo group unless one is already initialised,
    and leave it afterwards; yields this process's rank (0 when run plainly). Joining, the
    ranks first agree on ``command`` (a library caller's verb and arguments)."""
    if not under_torchrun():
        yield 0
        return
    import torch.distributed as dist  # only under torchrun: plain runs never import it

    if dist.is_initialized():
        yield dist.get_rank()
        return
    store, rank, world_size = _rendezvous()
    if command is not None:
        agree(store, rank, world_size, node_id(), command)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
                            timeout=store_timeout())
    token = _verb_run.set(True)  # the group is this verb's: every rank runs it
    try:
        with present(Presence(store, rank, world_size)):
            yield rank
    finally:
        _verb_run.reset(token)
        dist.destroy_process_group()


# Whether every rank of the process group runs this verb: set where the verb joined the group
# itself, or by the command line (``torchrun_session``). A library caller whose group exists
# for training (and may call a verb on rank 0 alone) never gets its work split: the other ranks
# would never join the collectives.
_verb_run: ContextVar[bool] = ContextVar("ckptctl_verb_run", default=False)


@contextlib.contextmanager
def torchrun_job(command: Command | None = None) -> Iterator[Job | None]:
    """``torchrun_group``, with the verb's work split over its ranks (``ops.distributed.joined``)
    when every rank runs the verb (see ``_verb_run``): yields the Job, or None for a plain run
    (which behaves exactly as without torchrun) and for a process group the verb did not join."""
    with torchrun_group(command):
        if not _verb_run.get():
            yield None
            return
        with joined() as job:
            yield job


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job of more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Session:
    """A command line's run under torchrun (``torchrun_session``); ``finish`` is its end."""

    def __init__(self, presence: Presence | None) -> None:
        self.presence = presence
        self.speaks = speaks()

    def finish(self) -> None:
        """Wait until every rank ended the command: rank 0 has printed the job's result (or
        its error) before any rank exits, as torchrun stops the remaining ranks as soon as one
        exits with an error. A rank gone by then changes nothing: the outcome is agreed."""
        if self.presence is None or self.presence.lost:
            return
        try:
            self.presence.arrive("the end of the command")
        except CoordinationError:
            pass


@contextlib.contextmanager
def torchrun_session(command: Command) -> Iterator[Session]:
    """A command line's whole run, printing included, on every rank of a torchrun job: the
    ranks agree on ``command`` (exit 2 when they differ, exit 3 naming a rank that never
    starts it), the group is joined for it, and every collective of the verb is bounded by
    the ranks' presence. The caller calls ``finish`` once the command ended, or failed in a
    way the ranks agree on. A plain run: a Session that does nothing."""
    if not under_torchrun():
        yield Session(None)
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        with torchrun_group(command):
            yield Session(current_presence())
        return
    # Joined before the command line ran (several commands in one process): agreed per command.
    store, rank, world_size = _default_store(), dist.get_rank(), dist.get_world_size()
    agree(store, rank, world_size, node_id(), command)
    token = _verb_run.set(True)
    try:
        with present(Presence(store, rank, world_size)) as presence:
            yield Session(presence)
    finally:
        _verb_run.reset(token)


def _rendezvous() -> tuple[Any, int, int]:
    """torchrun's store, this rank and the world size, from its environment (env://)."""
    import torch.distributed as dist

    try:
        return next(iter(dist.rendezvous("env://", timeout=store_timeout())))
    except ValueError as e:  # a variable torchrun sets is missing or malformed
        raise UsageError(f"WORLD_SIZE is {os.environ.get('WORLD_SIZE')} but torchrun's environment is incomplete: {e}",
                         hint="launch with torchrun, or unset WORLD_SIZE to run alone") from None
    except RuntimeError as e:  # its store cannot be reached
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CoordinationError(f"cannot reach the torchrun job's store: {first}",
                                hint="torchrun stopped, or MASTER_ADDR/MASTER_PORT are wrong") from None


def _default_store() -> Any:
    """The store of the group a caller initialised (the one its ranks rendezvoused through)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # private, hence guarded

        return _get_default_store()
    except (ImportError, AttributeError, ValueError, RuntimeError) as e:
        raise CoordinationError(f"the process group's store cannot be reached ({e})",
                                hint="join the group with torch.distributed.init_process_group, or let "
                                     "ckptctl join it") from None


__all__ = ["Session", "torchrun_group", "torchrun_job", "torchrun_session", "under_torchrun"]
