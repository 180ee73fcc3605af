"""What a copy of one checkpoint writes, in which order, and what proves each file's bytes
while it streams: the data a layout's copying members (``Layout.copy_source`` and after)
answer in, so that the one copy engine (``ops.transfer.engine``) never asks who wrote a
checkpoint. Used by ``cp``, ``restore``, ``sync`` and tier promotion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.seal import SealedFile
from ckptctl.layouts.checked import Level


@dataclass(frozen=True)
class ByManifest:
    """A file proven by ckptctl's manifest: its header must be the one the manifest commits
    (and its chunks fit the manifest's tensors), every chunk must match its checksum and the
    file its checksum, checked as it streams."""

    entry: FileEntry
    manifest: Manifest


@dataclass(frozen=True)
class BySeal:
    """A file proven by a seal (``ckptctl seal``): its size, XXH3-64 and chunk digests."""

    sealed: SealedFile
    chunk_size: int


# What proves a file's bytes while it is copied; None: nothing does (an unsealed checkpoint of
# another tool), and the copy is checked at the destination instead (``CopySource.check_after``).
Proof = Union[ByManifest, BySeal, None]


@dataclass(frozen=True)
class ToCopy:
    """One file of a checkpoint, as a copy writes it."""

    name: str  # relative to the checkpoint; for a checkpoint that is one file, its own name
    size: int
    proof: Proof
    # Read by the layout's commit rule (``trainer_state.json``, DCP's ``.metadata``): written
    # after every other file, so that a copy cut short never reads as complete to the stack.
    commit: bool = False
    ranks: frozenset[int] | None = None  # the ranks that read it (ckptctl's shards); None: every rank


@dataclass(frozen=True)
class CopySource:
    """One committed checkpoint as a copy reads it (``Layout.copy_source``): its files in the
    order a copy writes them, each with what proves it, and what the layout commits a copy with.
    Plain data, so that a torchrun job's rank 0 reads it once and sends it to every rank."""

    name: str  # its name under its root: the name its copy takes under a destination root
    step: int
    files: tuple[ToCopy, ...]  # the data files, then the commit files, in writing order
    # The layout's own record of the checkpoint (ckptctl's: the manifest and marker as read; a
    # sealed checkpoint's: its seal): what ``commit_copy`` writes, last.
    record: object
    # Bytes that are equal for two copies of one checkpoint and differ otherwise (ckptctl's
    # manifest; a seal), so that a damaged copy of this very checkpoint is repaired in place
    # while anything else committed there is refused; b"" when the layout has none (an
    # unsealed checkpoint of another tool: a destination is this checkpoint only byte for byte).
    identity: bytes
    check_before: Level | None = None  # the source's check before a byte is copied
    check_after: Level | None = None  # the copy's check once its files are in, before it is reported
    note: str | None = None  # how the copy is checked, in words (``CopyResult.note``)
    world_size: int | None = None  # the ranks it was saved by, when ckptctl can re-shard it


# What a destination already commits (``Layout.copy_committed``): "nothing"; "this" checkpoint,
# told by its record; or one of this layout's checkpoints its record cannot tell apart
# ("unproven": an unsealed one, or a sealed source over a copy whose seal was never written).
AtDestination = Literal["nothing", "this", "unproven"]
