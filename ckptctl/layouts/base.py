"""What the catalog knows about a checkpoint, and what a layout must answer to be listed.

A *layout* is one tool's way of putting checkpoints under a root (ckptctl's own is
``native.NativeLayout``; other tools' are ``stack.StackLayout`` subclasses: ``dcp``,
``hf_trainer``, ``megatron``, ``deepspeed``). The catalog asks each layout whether a root's
child is one of its checkpoints and, if so, what state it is in; everything else about the
layout stays in its own module.

Ownership is decided from a directory's files, not only from its name: ``step-N`` is both
ckptctl's and torchtitan's name, so a directory is a layout's own only when that layout
``claims`` its files. A directory that no layout claims is listed as ``unknown`` and is never
deleted by anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol, Sequence, Union

from ckptctl.errors import CheckpointError
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.seal import SealedFile
from ckptctl.storage.base import ObjectInfo, Storage

# committed: complete by its layout's own commit rule (contents not verified); partial: the
# layout's own checkpoint, not committed yet (being written, or abandoned); corrupt: claims to
# be committed but is not self-consistent; link: a symlink under the root, which ckptctl never
# follows; unknown: named like a checkpoint, but no layout recognises its files as its own.
Status = Literal["committed", "partial", "corrupt", "link", "unknown"]

UNKNOWN = "unknown"  # the layout name of an entry no layout claims


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint under a root, as the catalog lists it."""

    step: int
    name: str  # the directory's name under the root
    url: str
    layout: str  # which layout recognised it ("ckptctl" for ckptctl's own, "unknown" for none)
    status: Status
    reason: str | None = None  # why it is not committed (None when committed)
    storage: Storage | None = None  # rooted at the checkpoint; None for a link (never followed)
    manifest: Manifest | None = None  # ckptctl's own layout, when committed

    def to_dict(self) -> dict[str, object]:
        """The JSON-friendly fields (no storage, no manifest)."""
        return {"step": self.step, "name": self.name, "url": self.url, "layout": self.layout,
                "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class Examined:
    """A layout's cheap look at one checkpoint directory (marker and manifest, no data)."""

    status: Literal["committed", "partial", "corrupt"]
    reason: str | None = None
    manifest: Manifest | None = None


# resumable: holds what its stack's resume reads besides the weights (optimizer state, and
# loader/train state where that stack saves them); export: model weights only (torchtitan's
# model-only last step, the Trainer's save_only_model, Lightning's save_weights_only).
Content = Literal["resumable", "export"]


@dataclass(frozen=True)
class CheckpointKind:
    """Whether a checkpoint can resume training, as its layout tells from names and headers,
    and why (one line naming the file or key that showed it)."""

    kind: Content
    reason: str

    @property
    def resumable(self) -> bool:
        return self.kind == "resumable"

    def to_dict(self) -> dict[str, str]:
        return {"content": self.kind, "content_reason": self.reason}


# A layout that does not tell exports apart (a third-party one) never hides a checkpoint.
NOT_TOLD = CheckpointKind("resumable", "its layout does not tell model-only exports apart")


def kind_of_checkpoint(layout: object, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
    """``layout.kind_of_checkpoint(ckpt, manifest)``; ``NOT_TOLD`` for a layout without it
    (a plugin written before the method existed): such checkpoints stay candidates."""
    method = getattr(layout, "kind_of_checkpoint", None)
    if method is None:
        return NOT_TOLD
    try:
        return method(ckpt, manifest)
    except CheckpointError as e:  # deleted or damaged while read: verify says what is wrong
        return CheckpointKind("resumable", f"not told apart: {str(e)[:160]}; verify judges it")


@dataclass(frozen=True)
class Resume:
    """What a stack's resume takes for one checkpoint: the path its default resume takes, and
    the arguments that resume exactly this checkpoint (``latest --resume-args``)."""

    path: str  # the path to hand over (a checkpoint directory, or the root for pointer stacks)
    option: str  # how the stack takes it, in words, e.g. "--resume_from_checkpoint PATH"
    argv: tuple[str, ...] = ()  # argv-ready arguments naming exactly this checkpoint
    # Whether ``path`` with the stack's default resume loads exactly this checkpoint: False
    # when the root's pointer (Megatron's tracker, DeepSpeed's ``latest``) names another one.
    exact: bool = True
    pointer: str | None = None  # the pointer file that makes ``path`` inexact, and what it names

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "option": self.option, "argv": list(self.argv), "exact": self.exact,
                "pointer": self.pointer}


@dataclass(frozen=True)
class Finding:
    """One problem a layout's check found in a checkpoint, naming the file when it is one."""

    message: str
    file: str | None = None
    hint: str | None = None


@dataclass
class Checked:
    """What a layout's check of one checkpoint found (``StackLayout.check``)."""

    step: int | None = None
    problems: list[Finding] = field(default_factory=list)
    files: int = 0
    bytes_read: int = 0
    not_loaded: list[str] = field(default_factory=list)  # "NAME: not decoded (...)": fails the load level
    structural: list[str] = field(default_factory=list)  # "NAME: decoded structurally, ..." (opcodes only)
    notes: list[str] = field(default_factory=list)  # what this level could not check


# --- copying: what a copy of one checkpoint writes, in which order (``ops.transfer.engine``) ----
#
# One engine copies a checkpoint of any layout (``cp``, ``restore``, ``sync``, tier promotion);
# it asks the checkpoint's layout what to write, in order, and what proves each file's bytes
# while it streams (the check while copying). The layout answers in data, so the engine never
# asks who wrote a checkpoint: ``CopySource`` below, from ``Layout.copy_source``.


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

CheckLevel = Literal["quick", "checksums", "load"]


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
    check_before: CheckLevel | None = None  # the source's check before a byte is copied
    check_after: CheckLevel | None = None  # the copy's check once its files are in, before it is reported
    note: str | None = None  # how the copy is checked, in words (``CopyResult.note``)
    world_size: int | None = None  # the ranks it was saved by, when ckptctl can re-shard it


# What a destination already commits (``Layout.copy_committed``): "nothing"; "this" checkpoint,
# told by its record; or one of this layout's checkpoints its record cannot tell apart
# ("unproven": an unsealed one, or a sealed source over a copy whose seal was never written).
AtDestination = Literal["nothing", "this", "unproven"]


class Layout(Protocol):
    """One tool's directory layout, as the catalog uses it."""

    name: str
    files_are_checkpoints: bool  # one file per checkpoint (Lightning, Composer), not a directory
    seal_note: str | None  # why ``seal`` leaves its checkpoints alone; None when it seals them
    pointer_file: str | None  # the root-level file the stack's default resume reads (DeepSpeed, Megatron)
    # Its committed checkpoints carry a manifest that records a checksum for every byte: verify
    # checks them against it (``ops.verify.checkpoint``) and the verification record remembers a success
    # by the manifest's digest (``ops.verify.cache``). False: the layout's own ``check`` judges
    # them, and a seal (``ckptctl seal``) is what vouches for their bytes.
    verified_by_manifest: bool
    # ckptctl itself writes, commits and deletes these checkpoints (``Checkpointer``): ``rm``
    # deletes them, and their anchor is the one a prune reports first. False: another tool
    # writes them; they are read, and pruned by that tool's own rules only.
    written_by_ckptctl: bool
    # The one file whose presence alone makes a checkpoint more than partial (committed, or
    # corrupt when what it commits does not hold), so a file listing tells partial apart; None
    # when the commit rule reads more than a listing shows (a file's content, a root pointer).
    commit_marker: str | None

    def for_root(self, root: Storage) -> "Layout":
        """This layout as it reads ``root`` (a pointer file at the root, for some stacks)."""

    def step_of(self, child: ObjectInfo) -> int | None:
        """The step a child of the root stands for, by its name, or None when it is not one of ours."""

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Whether a directory whose immediate children are ``names`` holds this layout's own
        files (complete or not): a directory no layout claims is never deleted."""

    def is_marked(self, ckpt: Storage) -> bool:
        """Whether ``ckpt`` claims to be committed: one cheap lookup (a stat or a HEAD)."""

    def examine(self, ckpt: Storage) -> Examined:
        """Status from the checkpoint's own metadata; never raises for a checkpoint problem."""

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        """``keys`` in the order a delete takes them: the file the commit rule reads first, so
        that a delete cut short never leaves something that reads as complete."""

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        """Resumable or a model-only export, from names and headers (no tensor data); asked of
        committed checkpoints only. ``manifest``: the one the catalog read (ckptctl's own)."""

    def resume(self, ckpt_path: str, step: int) -> Resume:
        """What resumes exactly the checkpoint at ``ckpt_path`` (of step ``step``) in the tool
        that wrote it (``latest``)."""

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        """Metrics the tool recorded for its committed checkpoints ``(name, step)`` under
        ``root``, by checkpoint name, read without loading any data (what ``KeepBest`` ranks
        by); empty when it records none ckptctl reads beside the manifest's own."""

    # --- copying (``ops.transfer.engine``): in the order a copy calls them -----------------

    def copy_source(self, ckpt: Storage) -> CopySource:
        """What a copy of the committed checkpoint ``ckpt`` writes, in order, and what proves
        each file. Raises NotFound (not committed) or InvalidCheckpoint (its commit record does
        not hold). Reads the commit record and lists the files; no data."""

    def copy_committed(self, source: CopySource, dst: Storage) -> "AtDestination":
        """What ``dst`` (where the copy goes) already commits by this layout's rule: nothing,
        this very checkpoint (by its record: a damaged file of it is then replaced), or a
        checkpoint the record cannot tell apart (present only when every file holds the
        source's bytes). Raises RefusedForSafety when it commits something else: that is never
        replaced."""

    def uncommit_copy(self, source: CopySource, dst: Storage) -> None:
        """Make a damaged copy of ``source`` at ``dst`` read as partial again, its commit
        record first, so that it can be completed; only ever called when ``source.identity``
        showed the copy is this very checkpoint."""

    def commit_copy(self, source: CopySource, dst: Storage, published: Sequence[str] = ()) -> None:
        """Commit the copy at ``dst`` once every file of ``source`` is there and proven: the
        commit record, written last and only where nothing has its name (a no-op when ``dst``
        commits this very checkpoint already). Raises RefusedForSafety when another writer
        committed the step first, having deleted the files this copy ``published`` that the
        winner does not name; nothing a commit names is ever replaced or deleted."""

    def pointer_after_copy(self, source: CopySource) -> tuple[str, bytes] | None:
        """The root-level pointer (key, content) that makes the copy the one its stack's
        default resume loads (DeepSpeed's ``latest``, Megatron's tracker), written after the
        commit and never moved to an older step; None for layouts without one."""

    def pointer_step(self, raw: bytes) -> int | None:
        """The step an existing pointer file's content names (None: unreadable)."""

    def assuming_pointer(self, name: str, step: int) -> "Layout":
        """This layout as it will read its root once the pointer names ``name`` (a copy is
        checked before its pointer is written)."""
