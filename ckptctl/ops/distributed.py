"""An offline verb's work split over the ranks of a torchrun job, and one outcome for all of them.

``ckptctl verify``, ``cp`` and ``restore`` started by ``torchrun`` share their files among the
job's ranks, each rank reading (and writing) only its share; torch.distributed (the gloo group
``ops.torchrun.torchrun_group`` joins) is the engine, no worker pool of our own. This module
holds what every such verb needs:

* ``Job``: who this process is (rank, world size) and where (its node: torchrun's
  ``GROUP_RANK``, else the host name, the rule of ``tiers.node_chain.node_id``), with the ranks
  that share its node; ``current()`` is the job of the running verb, set by ``joined()``.
  Only a verb run on every rank enters ``joined()`` (``ops.torchrun.torchrun_job`` decides: the
  command line under torchrun, or a verb that joined the group itself); a library caller whose
  process group exists for training (a verb called on rank 0 alone, the ``Checkpointer``'s
  background verification) gets None and works alone, so nothing here makes one rank wait in a
  collective for others that never come. The job lives in a context variable: threads a verb
  starts do not inherit it.
* ``share``: a deterministic split of sized items over ranks, balanced by bytes (largest first,
  each to the least loaded rank; ties to the lowest rank), the same on every rank without
  talking.
* ``everyone``, ``agree`` and ``gathered`` (both at once): gather each rank's result (every
  rank gets all of them, so every rank makes the same next decision) and the all-ok rule: when any rank failed, every rank
  raises the lowest failing rank's error, naming that rank, so that the job exits with one
  message and one exit status everywhere.
* ``on_root``: work that only one rank should do (another tool's checkpoint, verified or
  copied whole), done on rank 0 and its answer (or failure) given to every rank.

Every collective here is entered once every rank arrived at it (``collective``, with
``ops.rollcall``): a rank that is gone is named within ``settings.TORCHRUN_TIMEOUT_S``.

May import: leaves only (``errors``), and ``ops.rollcall``.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import socket
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

from ckptctl.errors import CkptError, CoordinationError, UsageError
from ckptctl.ops.rollcall import current_presence

T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """This process's place in a torchrun job: its rank and every rank's node."""

    rank: int
    nodes: tuple[str, ...]  # the node of each rank, by rank

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def node(self) -> str:
        return self.nodes[self.rank]

    @property
    def node_ranks(self) -> tuple[int, ...]:
        """The ranks on this process's node, lowest first."""
        return tuple(r for r, n in enumerate(self.nodes) if n == self.node)

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its node (writes its manifest and marker): the lowest."""
        return self.rank == self.node_ranks[0]

    @property
    def node_order(self) -> tuple[str, ...]:
        """The nodes in the order of their lowest rank (torchrun numbers ranks node by node)."""
        return tuple(dict.fromkeys(self.nodes))

    def node_targets(self, world_size: int) -> list[int]:
        """The ranks of a job of ``world_size`` whose shards this node holds: its own ranks when
        this job has that many ranks; otherwise an equal block per node, in node order (node k
        of n gets ranks ``k*M/n`` to ``(k+1)*M/n - 1``, as torchrun numbers a job of M ranks on
        the same n nodes)."""
        if world_size == self.world_size:
            return list(self.node_ranks)
        n = len(self.node_order)
        if world_size % n:
            raise UsageError(
                f"--world-size {world_size} does not split evenly over the {n} nodes of this torchrun job",
                hint=f"give a multiple of {n}, or launch restore with {world_size} ranks in all "
                     "(each node holds the shards of its own ranks)")
        per = world_size // n
        k = self.node_order.index(self.node)
        return list(range(k * per, (k + 1) * per))


_current: ContextVar[Job | None] = ContextVar("ckptctl_job", default=None)


def current() -> Job | None:
    """The torchrun job the running verb splits its work over, or None (work alone)."""
    return _current.get()


def node_id() -> str:
    """This process's node: torchrun's node rank (two "nodes" on one host stay two), else the
    host name. The same rule as the tiers' (``tiers.node_chain.node_id``), so a restore's node
    is the node-local tier's node."""
    group = os.environ.get("GROUP_RANK")
    return f"node-{group}" if group is not None else socket.gethostname()


@contextlib.contextmanager
def joined() -> Iterator[Job | None]:
    """For the verb's duration, split work over the initialised process group (yields the Job;
    every rank learns every rank's node, one collective), or yield None when there is none or
    it has one rank. Rank 0 of a job speaks for it: see ``speaks``."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never imported here: a plain run has no group
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        yield None
        return
    nodes: list = [None] * dist.get_world_size()
    collective(lambda: dist.all_gather_object(nodes, node_id()), "joining the job")
    token = _current.set(Job(dist.get_rank(), tuple(nodes)))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Work alone inside a job (``on_root``'s work, a node leader's own check): nothing called
    in here splits its work or waits for the other ranks."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def speaks() -> bool:
    """Whether this process prints the verb's result: rank 0 of a torchrun job, or a plain run.
    From torchrun's environment (RANK), so the command line can ask before any group exists."""
    return os.environ.get("RANK", "0") == "0"


def share(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` split into ``parts`` lists balanced by size: largest first, each to
    the part with the fewest bytes so far (ties: the lower part, then the lower index), each
    part's indices in ascending order. Deterministic: every rank computes the same split."""
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + sizes[i], p))
    return [sorted(o) for o in out]


def mine(job: Job | None, sizes: Sequence[int], among: Sequence[int] | None = None) -> list[int]:
    """The indices of ``sizes`` this rank takes: all of them without a job; else its part of
    the split over ``among`` (default: every rank of the job). A rank not in ``among`` takes none."""
    if job is None:
        return list(range(len(sizes)))
    ranks = list(range(job.world_size)) if among is None else list(among)
    if job.rank not in ranks:
        return []
    return share(sizes, len(ranks))[ranks.index(job.rank)]


def attempt(fn: Callable[[], T]) -> tuple[T | None, CkptError | None]:
    """Run ``fn``: (its result, None), or (None, the CkptError it raised). A rank that raised on
    its own would leave the others waiting in the next collective; this one reports instead."""
    try:
        return fn(), None
    except CkptError as e:
        return None, e


def everyone(job: Job | None, value: T) -> list[T]:
    """Every rank's ``value``, by rank, on every rank (``[value]`` without a job)."""
    if job is None:
        return [value]
    import torch.distributed as dist

    out: list = [None] * job.world_size
    collective(lambda: dist.all_gather_object(out, value), "an exchange of results")
    return out


def agree(job: Job | None, failure: CkptError | None) -> None:
    """The all-ok rule: raise on every rank when any rank failed (the lowest failing rank's
    error, of its class, so the exit status is the same everywhere, its message naming the
    rank and how many others failed); return on every rank when none did."""
    gathered(job, None, failure)


def gathered(job: Job | None, value: T, failure: CkptError | None) -> list[T]:
    """Every rank's ``value`` (as ``everyone``) when no rank failed; otherwise ``agree``'s
    raise, on every rank: one collective for both."""
    if job is None:
        if failure is not None:
            raise failure
        return [value]
    pairs = everyone(job, (value, failure))
    failed = [(r, f) for r, (_, f) in enumerate(pairs) if f is not None]
    if not failed:
        return [v for v, _ in pairs]
    rank, first = failed[0]
    more = f" (and {len(failed) - 1} other rank(s) failed)" if len(failed) > 1 else ""
    text = str(first)
    if not text.startswith("rank "):  # already named by an inner agreement
        first.args = (f"rank {rank}: {text}{more}", *first.args[1:])
    raise first


def unanimous(job: Job | None, value: T, what: str) -> T:
    """``value``, checked to be the same on every rank (what each rank saw of shared storage:
    when the ranks saw different things, it changed under them, and no rank goes on)."""
    if job is not None and len({repr(v) for v in everyone(job, value)}) > 1:
        raise CoordinationError(f"the ranks of this torchrun job saw different things at {what} (it changed meanwhile)",
                                hint="run the command again once nothing else writes there")
    return value


def on_root(job: Job | None, fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 alone (``alone``), its result (or failure) given to every rank."""
    if job is None:
        return fn()
    result, failure = None, None
    if job.rank == 0:
        with alone():
            result, failure = attempt(fn)
    box = [(result, failure)]
    import torch.distributed as dist

    collective(lambda: dist.broadcast_object_list(box, src=0), "rank 0's answer")
    result, failure = box[0]
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]


def collective(fn: Callable[[], object], what: str = "a collective") -> None:
    """A collective, entered once every rank has arrived at it (``rollcall.Presence.arrive``:
    a rank that is gone is named within the timeout, not waited for); a rank that died during
    it (killed, or out of memory) is one line and exit 3 on the others, not gloo's traceback."""
    presence = current_presence()
    if presence is not None:
        presence.arrive(what)
    try:
        fn()
    except RuntimeError as e:  # gloo reports a peer that closed its connection this way
        first = (str(e).strip().splitlines() or [""])[0]
        raise CoordinationError(
            f"a rank of this torchrun job left before the others agreed: {first}",
            hint="see that rank's log (killed, out of memory?), then run the command again") from None
