"""What a layout is: the whole handler of one tool's checkpoints, and what the catalog lists.

A *layout* is one tool's way of putting checkpoints under a root, and everything a verb needs
to do with one of them: recognise it and its step, tell complete from partial, delete it in
an order that never leaves something complete-looking, check it at every level, show what it
holds, seal it, read and write the pointer its tool resumes from, say whether it resumes
training and with which arguments, and read the metrics its tool recorded. Every verb asks
the ``Layout`` protocol below and nothing else, so ckptctl's own format (``native``) is one
implementation beside the other tools' (``dcp``, ``hf_trainer``, ``megatron``, ``deepspeed``,
``lightning``, ``accelerate``, ``composer``, ``nemo``: those share ``stack.StackLayout``, an
implementation detail) and beside any plugin's (``registry``: an object with these members,
subclassing nothing; ``docs/extending.md``).

The order a verb calls them in (every call with a ``Storage`` rooted at the checkpoint; for a
layout whose checkpoints are files, rooted at the file, key ""):

1. ``for_root(root)``: the layout bound to a root (its pointer file read, once per listing);
2. ``step_of(child)`` for each child of the root, then ``claims(ckpt, names)`` with one
   listing of a child some layout named: the first layout that claims it owns it
   (``classify``: ``claims_alone`` for a path named by itself, whatever its name);
3. ``examine(ckpt)``: committed, partial or corrupt by the tool's own commit rule (no data
   read; ``commit_marker``, when set, is the one file whose presence tells partial apart);
4. ``kind_of_checkpoint(ckpt)``: resumable or a model-only export, from names and headers;
5. ``check(ckpt, level)``: every file at ``quick``, ``checksums`` or ``load``; a ``Checked``
   whose problems are in files ``reads_on_resume`` names (what the stack never reads on
   resume is reported, never a reason to call the checkpoint broken); ``identity(ckpt)``
   keys a success in the verification record; ``inspect(ckpt)`` shows what it holds;
6. ``resume(path, step)``: what resumes exactly this checkpoint (``latest``);
7. deleting (``prune``, ``rm``): ``protected(entries)`` first, then ``removal_order(keys)``:
   the file the commit rule reads goes first;
8. pointers (``verify --latest``, ``repoint``, copies): ``pointer_target``, ``pointer_for``,
   ``pointer_step``, ``assuming_pointer``, for tools that commit by a root-level file;
9. copying (``cp``, ``restore``, ``sync``, tier promotion: ``ops.transfer.engine``):
   ``copy_source(ckpt)`` (the files in writing order, each with what proves its bytes:
   ``layouts.copying``), then at the destination ``copy_committed``, ``uncommit_copy`` (only
   for a damaged copy of this very checkpoint), ``commit_copy`` (last, write-if-absent) and
   ``pointer_after_copy``.

Ownership is decided from a directory's files, not only from its name: ``step-N`` is both
ckptctl's and torchtitan's name. A directory no layout claims is listed as ``unknown`` and is
never deleted by anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal, Protocol, Sequence

from ckptctl.errors import CheckpointError
from ckptctl.format.manifest import Manifest
from ckptctl.layouts.checked import ALONE, Checked, Level, Split
from ckptctl.layouts.inspected import Inspected
from ckptctl.layouts.copying import AtDestination, CopySource
from ckptctl.storage.base import ObjectInfo, Storage

if TYPE_CHECKING:
    from ckptctl.layouts.aliases import Alias
    from ckptctl.progress import Progress

# committed: complete by its layout's own commit rule (contents not verified); partial: the
# layout's own checkpoint, not committed yet (being written, or abandoned); corrupt: claims to
# be committed but is not self-consistent; link: a symlink under the root, which ckptctl never
# follows; unknown: named like a checkpoint, but no layout recognises its files as its own.
Status = Literal["committed", "partial", "corrupt", "link", "unknown"]

UNKNOWN = "unknown"  # the layout name of an entry no layout claims

# What the number in a checkpoint's name counts: a training step for nearly every tool;
# accelerate's automatic ``checkpoint_N`` counts ``save_state`` calls and its examples'
# ``epoch_N`` epochs. A rule that reads numbers as training steps (``prune --keep-every``,
# ``--keep``) refuses a root whose numbers count anything else.
Numbering = Literal["step", "save index", "epoch"]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint under a root, as the catalog lists it."""

    step: int
    name: str  # the directory's name under the root
    url: str
    layout: str  # which layout recognised it ("unknown" for none)
    status: Status
    reason: str | None = None  # why it is not committed (None when committed)
    storage: Storage | None = None  # rooted at the checkpoint; None for a link (never followed)
    manifest: Manifest | None = None  # what a layout that keeps one read while examining it
    owner: "Layout | None" = None  # its layout, bound to the root; None for unknown entries

    def to_dict(self) -> dict[str, object]:
        """The JSON-friendly fields (no storage, no manifest, no layout object)."""
        return {"step": self.step, "name": self.name, "url": self.url, "layout": self.layout,
                "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class Examined:
    """A layout's cheap look at one checkpoint (its commit record, no data)."""

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


# A layout that does not tell exports apart (a plugin's may not) never hides a checkpoint.
NOT_TOLD = CheckpointKind("resumable", "its layout does not tell model-only exports apart")


def kind_of_checkpoint(layout: "Layout", ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
    """``layout.kind_of_checkpoint(ckpt, manifest)``, a checkpoint deleted or damaged while it
    was read counted as resumable: verify then says what is wrong with it."""
    try:
        return layout.kind_of_checkpoint(ckpt, manifest)
    except CheckpointError as e:
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
class ModelWeights:
    """Where a checkpoint that no file format's reader takes whole keeps its model weights, as
    its layout says (``convert`` of a DeepSpeed tag): one ``torch.save`` file, read with
    ``weights_only=True`` and ``allowed`` globals only (never unpickled); what else that file
    holds comes along as state; ``left_out`` says what of the checkpoint does not, and why."""

    file: str  # its key, relative to the checkpoint
    allowed: tuple[object, ...] = ()  # globals torch's weights-only loader may build besides its own
    left_out: tuple[str, ...] = ()


class Layout(Protocol):
    """The handler of one tool's checkpoints: every verb asks these members and nothing else."""

    name: str  # lower case: ls's FORMAT column, --format, the JSON "layout"
    title: str  # the tool, in words ("Hugging Face Trainer")

    # --- recognise and step ------------------------------------------------------------------

    files_are_checkpoints: bool  # one file per checkpoint (Lightning, Composer), not a directory

    def for_root(self, root: Storage) -> "Layout":
        """This layout as it reads ``root`` (its pointer file read, for tools that have one)."""

    def step_of(self, child: ObjectInfo) -> int | None:
        """The step a child of the root stands for, by its name; None when it is not one of ours."""

    def numbered_by(self, name: str) -> Numbering:
        """Optional: what the number ``step_of`` read in the checkpoint name ``name`` counts (a
        layout without the member numbers by step: ``numbered_by`` below)."""

    def aliases(self) -> "list[Alias]":
        """Optional: files the tool keeps under the root standing for one of its checkpoints
        (Lightning's ``last.ckpt``): shown by ``ls``, never a checkpoint (``layouts.aliases``)."""

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Whether a directory named as ours, whose immediate children are ``names``, holds our
        files (complete or not): a directory no layout claims is never deleted."""

    def claims_alone(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Whether a directory holding ``names`` is ours whatever it is called (a path named by
        the user, not listed under a root: a DCP directory, a ``cp`` destination)."""

    # --- commit rule and removal ---------------------------------------------------------------

    # The one file whose presence alone makes a checkpoint more than partial (committed, or
    # corrupt when what it commits does not hold), so a file listing tells partial apart; None
    # when the commit rule reads more than a listing shows (a file's content, a root pointer).
    commit_marker: str | None
    # The files the commit rule reads: a delete takes them first (``removal_order``), a copy
    # writes them last.
    commit_files: tuple[str, ...]

    def examine(self, ckpt: Storage) -> Examined:
        """Committed, partial or corrupt by the tool's commit rule, from its metadata only;
        never raises for a checkpoint problem (only for storage that cannot be read)."""

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        """``keys`` in the order a delete takes them: the file the commit rule reads first, so
        that a delete cut short never leaves something that reads as complete."""

    # --- checking and inspecting ---------------------------------------------------------------

    def check(self, ckpt: Storage, level: Level, *, split: Split = ALONE,
              progress: "Progress | None" = None) -> Checked:
        """Every file at ``level`` (each level includes the ones before): by the tool's commit
        rule, the checksums that exist (a manifest's, a seal's, the tool's own CRC-32s),
        structure, and at ``load`` a test-load of what the stack reads on resume (decoded
        structurally where torch refuses it, never unpickled). Problems go in the result; it
        raises only for storage that cannot be read. ``split`` shares the work among the
        processes of a job; ``progress`` is told the bytes read."""

    def reads_on_resume(self, rel: str) -> bool:
        """Whether the tool's resume reads the file ``rel`` (relative to the checkpoint): only
        those must pass the load level; what is wrong with the others is reported only."""

    def identity(self, ckpt: Storage) -> str | None:
        """What names this checkpoint's contents beyond its files' names, sizes and times
        (ckptctl's own: the manifest checksum its marker records), keying a success in the
        verification record; None when nothing does (its checks are then never recorded)."""

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> Inspected:
        """What the checkpoint holds (``tensors``: each tensor too). Raises InvalidCheckpoint
        when nothing reads it (a tool's files of no format ckptctl reads), UsageError when its
        reader needs a local path and it is on object storage."""

    def model_weights(self, ckpt: Storage) -> ModelWeights | None:
        """Optional: the file holding the model weights of a checkpoint whose files no format
        reader takes as a whole, for ``convert``; None when a reader does. Raises UsageError
        when no one file holds them (ZeRO-3 partitions, tensor parallel ranks)."""

    # --- seal ------------------------------------------------------------------------------------

    # Why ``seal`` leaves its checkpoints alone (its own checksums already cover every byte, or a
    # checkpoint that is one file has no directory for a seal); None when ``seal`` seals them.
    seal_note: str | None

    # --- pointers: the root-level file some tools resume from (DeepSpeed, Megatron) ----------------

    pointer_file: str | None  # its key under the root; None when the tool has none

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        """The root's pointer as read (key, the checkpoint name it names, its step); None when
        there is none or it is unreadable."""

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        """The pointer file (key, content) that commits the checkpoint ``name``; None for tools
        whose commit rule reads no pointer."""

    def pointer_step(self, raw: bytes) -> int | None:
        """The step an existing pointer's content names (None: unreadable)."""

    def assuming_pointer(self, name: str, step: int) -> "Layout":
        """This layout as if the root's pointer named ``name`` (a copy checks what it wrote,
        then commits it by writing the pointer)."""

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Names under the root no deletion may touch, with why (a pointer's target, a best
        checkpoint), given (name, status) of this layout's entries; a pointer that cannot be
        read protects every entry it might name."""

    # --- resume ----------------------------------------------------------------------------------

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        """Resumable or a model-only export, from names and headers (no tensor data); asked of
        committed checkpoints. ``manifest``: the one ``examine`` read, when it keeps one."""

    def resume(self, ckpt_path: str, step: int) -> Resume:
        """What resumes exactly the checkpoint at ``ckpt_path`` (of step ``step``) in its tool."""

    # --- metrics ---------------------------------------------------------------------------------

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        """Metrics the tool recorded for its committed checkpoints ``(name, step)`` under
        ``root``, by name, read without loading data (what ``KeepBest`` ranks by); empty when
        it records none beside what ``examine`` read."""

    # --- copying (``ops.transfer.engine``): in the order a copy calls them -----------------

    def copy_source(self, ckpt: Storage) -> CopySource:
        """What a copy of the committed checkpoint ``ckpt`` writes, in order, and what proves
        each file. Raises NotFound (not committed) or InvalidCheckpoint (its commit record does
        not hold). Reads the commit record and lists the files; no data."""

    def copy_committed(self, source: CopySource, dst: Storage) -> AtDestination:
        """What ``dst`` (where the copy goes) already commits by this layout's rule: nothing,
        this very checkpoint (by its record: a damaged file of it is then replaced), or a
        checkpoint the record cannot tell apart (present only when every file holds the
        source's bytes). Raises RefusedForSafety when it commits something else: that is never
        replaced."""

    def copy_ahead(self, source: CopySource, dst: Storage) -> tuple[str, ...]:
        """Optional: before the data, write the part of the commit record that commits nothing
        without the rest (ckptctl's manifest: its marker commits), each file only where nothing
        has its name, so that less is left to follow the last data file. Returns the keys this
        call wrote (the copy's own, to take back should it fail before it commits; given to
        ``commit_copy`` in ``published``); a key found holding exactly these bytes is not
        returned. Raises RefusedForSafety when one holds other bytes. Asked only when
        ``copy_committed`` found nothing there (or beside that question: what it wrote is taken
        back when the answer is another). A layout without it writes its whole record last."""

    def uncommit_copy(self, source: CopySource, dst: Storage) -> None:
        """Make a damaged copy of ``source`` at ``dst`` read as partial again, its commit
        record first, so that it can be completed; only ever called when ``source.identity``
        showed the copy is this very checkpoint."""

    def commit_copy(self, source: CopySource, dst: Storage, published: Sequence[str] = ()) -> None:
        """Commit the copy at ``dst`` once every file of ``source`` is there and proven: the
        commit record, written last and only where nothing has its name (a no-op when ``dst``
        commits this very checkpoint already; what ``copy_ahead`` wrote is in ``published``
        and not written again). Raises RefusedForSafety when another writer
        committed the step first, having deleted the files this copy ``published`` that the
        winner does not name; nothing a commit names is ever replaced or deleted."""

    def pointer_after_copy(self, source: CopySource) -> tuple[str, bytes] | None:
        """The root-level pointer (key, content) that makes the copy the one its stack's
        default resume loads (DeepSpeed's ``latest``, Megatron's tracker), written after the
        commit and never moved to an older step; None for layouts without one."""


# Members a plugin written before they existed may lack: each is asked through a function that
# answers for a layout without it (``numbered_by`` and ``model_weights`` below, ``aliases.aliases``).
OPTIONAL: frozenset[str] = frozenset({"numbered_by", "model_weights", "aliases", "copy_ahead"})
# Every member a layout must have: what the registry asks of a plugin's object, by name.
MEMBERS: tuple[str, ...] = tuple(sorted((set(Layout.__annotations__) | {
    name for name, value in vars(Layout).items() if callable(value) and not name.startswith("_")}) - OPTIONAL))


def copy_ahead(layout: Layout, source: CopySource, dst: Storage) -> tuple[str, ...]:
    """``layout.copy_ahead(source, dst)``: the keys of the commit record written before the
    data; none for a layout without the member (its record is written whole, last)."""
    ahead = getattr(layout, "copy_ahead", None)
    return () if ahead is None else tuple(ahead(source, dst))


def numbered_by(layout: Layout, name: str) -> Numbering:
    """``layout.numbered_by(name)``: what the number in the checkpoint name ``name`` counts;
    ``step`` for a layout without the member (a plugin older than it)."""
    ask = getattr(layout, "numbered_by", None)
    return "step" if ask is None else ask(name)


def numbered(counts: str, number: int | None) -> str:
    """How every verdict names a checkpoint's number: ``step 20``, or what it counts instead
    (``save index 2`` for accelerate's ``checkpoint_2``), never a save index called a step."""
    return f"{counts} {'-' if number is None else number}"


def model_weights(layout: Layout, ckpt: Storage) -> ModelWeights | None:
    """``layout.model_weights(ckpt)``; None for a layout without the member."""
    ask = getattr(layout, "model_weights", None)
    return None if ask is None else ask(ckpt)
