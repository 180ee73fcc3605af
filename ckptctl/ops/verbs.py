"""The verbs by path or URL, as the CLI names them: open the storage, say what the path is, run.

Every verb of the ``ckptctl`` command calls exactly one function here, in ``ops.verify_verbs``
(the verbs that judge checkpoints: ``verify``, ``latest``, ``repoint``), or in ``ckptctl.ops``
directly when it takes plain values, so the command line never opens storage itself. What a
path names is ``layouts.classify``'s one answer (every verb here asks it once), and the errors
for a wrong one are ``ops.targets``'.

Functions that need torch (reading other tools' formats, reshard, convert) import it when
called: ``ckptctl ls`` and ``latest`` start without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ckptctl.errors import UsageError
from ckptctl.ops.targets import ckptctl_checkpoint, existing, one_checkpoint, open_existing, open_root
from ckptctl.progress import Progress
from ckptctl.storage import open_storage

if TYPE_CHECKING:  # only for annotations: importing these pulls in torch
    from ckptctl.layouts.classify import Found
    from ckptctl.ops.distributed import Job
    from ckptctl.ops.transform.convert import ConvertReport
    from ckptctl.ops.interval import IntervalAdvice
    from ckptctl.ops.inspect import ForeignInspect, InspectResult
    from ckptctl.layouts.aliases import Alias
    from ckptctl.ops.listing import Listed
    from ckptctl.ops.retention.prune import PruneOutcome, PrunePlan
    from ckptctl.ops.transform.reshard import ReshardReport
    from ckptctl.ops.retention.policies import RetentionPolicy
    from ckptctl.ops.save_stats import SaveStats
    from ckptctl.ops.transfer.copy import CopyResult, RestoreResult, Skipped


# --- inspect, ls ---------------------------------------------------------------------------


def inspect_path(path: str, *, tensors: bool = False) -> "InspectResult | ForeignInspect":
    """What the checkpoint at ``path`` holds, by its handler (``ops.inspect``): a ckptctl
    checkpoint from its manifest, another tool's through its files' reader (the result's
    ``format`` field tells them apart)."""
    return one_checkpoint(path, verb="inspect").inspect(tensors=tensors)


@dataclass
class RootListing:
    """``ls``'s answer: the checkpoints of a root, and, when there are none but the path's
    subdirectories hold some (torchtitan's dump folder holds them in ``checkpoint/``), a hint
    saying where (printed on stderr; the listing itself stays the truth about this root)."""

    rows: "list[Listed]"
    hint: str | None = None
    aliases: "list[Alias]" = field(default_factory=list)  # Lightning's last.ckpt: never a checkpoint of its own


def _checkpoint_not_root(path: str, what: str) -> UsageError:
    parent = listing_parent(path)
    return UsageError(f"{path} is {what}, not a root of checkpoints",
                      hint=f"`ckptctl inspect {path}` shows what it holds; `ckptctl ls {parent}` lists it beside the others")


def listing_parent(path: str) -> str:
    from ckptctl.ops.listing import parent_of

    return parent_of(path)


def list_root(root: str) -> RootListing:
    """Every checkpoint under the root at ``root`` (``ops.listing.list_checkpoints``).
    The wrong level is named: one checkpoint given as the root is a UsageError (exit 2: it
    holds no checkpoints of its own, and "0 checkpoints" would read as a fresh run); a root
    with none whose subdirectories hold some gets a hint naming them."""
    from ckptctl.ops import listing

    found = existing(root)
    local = found.local
    if local is not None and os.path.isfile(local) and found.description is not None:  # a one-file checkpoint
        raise _checkpoint_not_root(root, found.description)
    st = open_root(root)
    rows = listing.list_checkpoints(st)
    if rows:
        return RootListing(rows, aliases=listing.aliases_under(st, rows))
    if found.description is not None:  # one checkpoint, not a root of them
        raise _checkpoint_not_root(root, found.description)
    below = listing.holders_below(found.storage)
    if not below:
        return RootListing(rows)
    first = listing.sub_path(root, below[0][0])
    return RootListing(rows, f"{listing.below_text(root, tuple(below))}: `ckptctl ls {first}`")


# --- prune, interval ------------------------------------------------------------------------


def prune_root(root: str, policy: "RetentionPolicy", *, review: "Callable[[PrunePlan], bool] | None" = None,
               progress: Progress | None = None, **options: object) -> "tuple[PrunePlan, PruneOutcome | None]":
    """``ops.retention.prune.prune`` of the root at ``root``; ``options`` are that function's keywords."""
    from ckptctl.ops.retention.prune import prune

    from ckptctl.ops.listing import wrong_level_error

    st = open_root(root)

    def reviewed(p: "PrunePlan") -> bool:  # before the plan is shown: a path one level off is named
        wrong = wrong_level_error(st, root, "ckptctl prune {} ...") if not p.items else None
        if wrong is not None:
            raise wrong
        return review(p) if review is not None else True

    return prune(st, policy, review=reviewed, progress=progress, **options)  # type: ignore[arg-type]


def advise_for_root(root: str, mtbf_s: float, *, cost_s: float | None = None) -> "tuple[IntervalAdvice, SaveStats]":
    """``ops.save_stats.advise_from_root`` of the root at ``root``."""
    from ckptctl.ops.save_stats import advise_from_root

    return advise_from_root(open_root(root), mtbf_s, cost_s=cost_s)


# --- cp, restore ----------------------------------------------------------------------------


@dataclass
class CopyOutcome:
    """Where ``cp`` put the checkpoint (a filesystem path, or the URL on object storage) and
    what the copy did."""

    path: str
    result: "CopyResult"

    def to_dict(self) -> dict:
        return {**self.result.to_dict(), "path": self.path}


def copy_to(src: str, dst: str, progress: Progress | None = None) -> CopyOutcome:
    """Copy the committed checkpoint at ``src`` to ``dst`` (where its layout names one of its
    checkpoints, or a root to put it under), checked on the fly (``ops.transfer.copy``). Under
    torchrun the ranks share its files (``dst`` must be shared by them: object storage or a
    shared filesystem)."""
    from ckptctl.ops.rollcall import Command, resolved
    from ckptctl.ops.torchrun import torchrun_job

    with torchrun_job(Command("cp", {"src": resolved(src), "dst": resolved(dst)})):
        return _copy_found(one_checkpoint(src, verb="cp"), dst, progress)


def _copy_found(found: "Found", dst: str, progress: Progress | None) -> CopyOutcome:
    from ckptctl.ops.transfer.copy import copy_found

    if found.what != "checkpoint":  # a file format: cp copies checkpoints (ops.targets says what it is)
        ckptctl_checkpoint(found, "cp")
    into = open_storage(dst)
    result = copy_found(found.in_layout, found.storage, into, progress)
    copied = open_storage(result.dst)
    return CopyOutcome(copied.local_path() or copied.url, result)


def restore_into(src_root: str, dst_root: str, step: int | None = None, progress: Progress | None = None, *,
                 world_size: int | None = None, on_skip: "Callable[[Skipped], None] | None" = None) -> "RestoreResult":
    """``ops.transfer.copy.restore_latest`` from the root at ``src_root`` (which must exist) into
    ``dst_root`` (created when missing). Under torchrun ``dst_root`` is each node's own disk and
    each node gets only the files its ranks read (``ops.transfer.node_restore``). Every rank
    returns rank 0's result."""
    from ckptctl.ops.rollcall import Command, resolved
    from ckptctl.ops.torchrun import torchrun_job

    command = Command("restore", {"src": resolved(src_root), "dst": resolved(dst_root), "step": str(step),
                                  "world_size": str(world_size)}, per_node=("dst",))  # each node's own disk
    with torchrun_job(command) as job:
        return _restore_into(src_root, dst_root, step, progress, world_size=world_size, on_skip=on_skip, job=job)


def _restore_into(src_root: str, dst_root: str, step: int | None, progress: Progress | None, *,
                  world_size: int | None, on_skip: "Callable[[Skipped], None] | None", job: "Job | None") -> "RestoreResult":
    from ckptctl.ops.transfer.copy import restore_latest

    found = existing(src_root)
    src = found.storage
    local = src.local_path()
    if local is not None and os.path.isfile(local):  # a one-file checkpoint (Lightning's .ckpt), or any file
        what = found.description or "a file"
        raise UsageError(f"{src_root} is {what}; restore copies checkpoint directories from a root of them",
                         hint="copy the file itself (cp, rsync, aws s3 cp)")
    if job is not None:
        from ckptctl.ops.transfer.node_restore import restore_to_nodes

        return restore_to_nodes(src, open_storage(dst_root), job, step, progress, world_size=world_size,
                                on_skip=on_skip if job.rank == 0 else None)
    return restore_latest(src, open_storage(dst_root), step, progress,
                          world_size=world_size, on_skip=on_skip, found=found)


# --- reshard, convert (torch) ---------------------------------------------------------------


def reshard_path(src: str, dst: str, world_size: int, *, overwrite: bool = False,
                 progress: Progress | None = None) -> "ReshardReport | None":
    """Reshard the checkpoint at ``src`` into ``dst`` for ``world_size`` ranks. Under torchrun
    the ranks share the work (``ops.torchrun.torchrun_group``); the report is returned on
    rank 0 only (None elsewhere: rank 0 speaks for the job)."""
    from ckptctl.interop.base import return_freed_memory
    from ckptctl.ops.transform.reshard import reshard
    from ckptctl.ops.torchrun import torchrun_group

    from ckptctl.ops.rollcall import Command, resolved

    source = ckptctl_checkpoint(one_checkpoint(src, verb="reshard"), "reshard")
    return_freed_memory()  # memory stays one tensor, not a heap of freed ones
    command = Command("reshard", {"src": resolved(src), "dst": resolved(dst), "world_size": str(world_size),
                                  "overwrite": str(overwrite)})
    with torchrun_group(command) as rank:
        report = reshard(source, open_storage(dst), world_size, overwrite=overwrite, progress=progress)
    return report if rank == 0 else None


def convert_path(src: str, dst: str, to: str, *, only: Sequence[str] = (), dtype: str | None = None,
                 max_shard_size: str | None = None, overwrite: bool = False,
                 progress: Progress | None = None, step: int | None = None,
                 strip_prefix: str | None = None) -> "ConvertReport":
    """``ops.transform.convert.convert`` with ``max_shard_size`` as the user wrote it (5GB, 500MiB)."""
    from ckptctl.interop.base import return_freed_memory
    from ckptctl.ops.transform.convert import convert, parse_size

    size = parse_size(max_shard_size) if max_shard_size is not None else None
    open_existing(src)
    return_freed_memory()  # memory stays one tensor, not a heap of freed ones
    return convert(src, dst, to, only=only, dtype=dtype, max_shard_size=size, overwrite=overwrite, progress=progress,
                   step=step, strip_prefix=strip_prefix)


__all__ = [
    "CopyOutcome", "RootListing", "advise_for_root", "convert_path", "copy_to", "inspect_path", "list_root",
    "prune_root", "reshard_path", "restore_into",
]
