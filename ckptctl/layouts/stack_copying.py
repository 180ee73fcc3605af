"""Copying another tool's checkpoint: what a ``StackLayout`` answers to the copy engine
(``layouts.base``, its copying section; the engine is ``ops.transfer.engine``).

A copy writes the stack's data files first, then the files its commit rule reads (the
layout's ``commit_files``: ``trainer_state.json``, DCP's ``.metadata``, ...), so that a copy
cut short reads as incomplete to the stack; then the seal, when the source has one; then, for
stacks committed by a pointer at the root (DeepSpeed ``latest``, Megatron's tracker), the
pointer, never moved to an older step (an older copy is still complete by those stacks'
rules, which take every step at or below the pointer's).

What proves the bytes: a sealed checkpoint's files are checked against the seal as they stream,
so a corrupt source commits nothing, on every backend. An unsealed one records no checksums
to check against, so its copy is test-loaded at the destination (``check_after`` "load", every
file, as ``verify --load`` does) before it is reported and its pointer written; sealing first
saves that read. A checkpoint that is one file (Lightning's ``.ckpt``, Composer's ``.pt``) is
copied whole and checked at the destination by its zip records' CRC-32s. Every source first
passes the quick level (``check_before``: the stack's commit rule, each file's own header), so
a safetensors file with trailing bytes is refused before a byte is copied.

The rules are functions of the layout, so a plugin layout (which subclasses nothing) answers
the copying section by calling them from its own methods; the built-in layouts get them as
methods from ``StackCopying``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ckptctl.errors import InvalidCheckpoint, NotFound, RefusedForSafety
from ckptctl.format.seal import MAX_SEAL_BYTES, SEAL, is_seal_file, parse_seal
from ckptctl.layouts.copying import AtDestination, BySeal, CopySource, ToCopy
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import regular_size

CHECKED_SEAL = "every byte checked against the source's seal on the fly"
CHECKED_LOAD = "no seal: copied, then every file test-loaded at the destination (no checksums to check bytes against)"
CHECKED_FILE = "copied whole, then its zip records' CRC-32s checked at the destination"


class _Copied(Protocol):
    """What the functions below read of a layout."""

    name: str
    files_are_checkpoints: bool
    commit_files: tuple[str, ...]

    def step_of(self, child: ObjectInfo) -> int | None: ...

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None: ...


def copy_source(layout: "_Copied", ckpt: Storage) -> CopySource:
    """Its files in writing order (data, then the commit files), each proven by the seal
    when there is one."""
    name = ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    step = layout.step_of(ObjectInfo(name, 0, 0.0, "file" if layout.files_are_checkpoints else "dir"))
    if step is None:
        # Named alone (a DCP directory called anything): nothing says which step it is under a
        # destination root, where its stack would look for it.
        raise InvalidCheckpoint(
            f"{ckpt.url} is a {layout.name} checkpoint; cp takes ckptctl checkpoints only, and another tool's "
            f"under a name its stack gives it",
            hint=f"make one first: `ckptctl convert {ckpt.url} DIR --to ckptctl`, or copy the root that holds it",
        )
    if layout.files_are_checkpoints:
        size = regular_size(ckpt, "")
        if size is None:
            raise NotFound(f"{ckpt.url} is gone", hint="it was deleted while being copied")
        return CopySource(name, step, (ToCopy("", size, None),), None, b"", check_before="quick",
                          check_after="checksums", note=CHECKED_FILE)
    seal_raw = ckpt.read(SEAL, max_size=MAX_SEAL_BYTES) if ckpt.stat(SEAL) is not None else None
    seal = parse_seal(seal_raw, ckpt.url_of(SEAL)) if seal_raw is not None else None
    sizes = {i.key: i.size for i in ckpt.list() if not is_seal_file(i.key)}
    if seal is not None and set(sizes) != set(seal.by_name()):
        raise InvalidCheckpoint(f"{ckpt.url}: its files differ from its seal", hint="verify it: `ckptctl verify SRC`")
    commit = [k for k in layout.commit_files if k in sizes]
    order = [k for k in sorted(sizes) if k not in commit] + commit
    by_name = seal.by_name() if seal is not None else {}
    files = tuple(ToCopy(k, sizes[k], BySeal(by_name[k], seal.chunk_size) if seal is not None else None,
                         commit=k in commit) for k in order)
    return CopySource(name, step, files, seal_raw, seal_raw or b"", check_before="quick",
                      check_after="quick" if seal is not None else "load",
                      note=CHECKED_SEAL if seal is not None else CHECKED_LOAD)


def copy_committed(layout: "_Copied", source: CopySource, dst: Storage) -> AtDestination:
    """A commit file (or the one file) at ``dst`` is a checkpoint of this layout; it is this
    very one when it carries the source's seal, else it is told apart only byte by byte. A
    different seal is refused."""
    if layout.files_are_checkpoints:
        # A plain file there is told apart byte by byte; anything else under its name (a
        # directory, a link) is never written over: the engine's publish finds the name taken.
        return "nothing" if regular_size(dst, "") is None else "unproven"
    if not any(dst.stat(k) is not None for k in layout.commit_files):
        return "nothing"  # nothing, or a copy cut short before its commit files: completed
    there = dst.stat(SEAL)
    if not source.identity or there is None:
        return "unproven"
    if dst.read(SEAL, max_size=MAX_SEAL_BYTES) == source.identity:
        return "this"
    raise RefusedForSafety(f"{dst.url} already holds another {layout.name} checkpoint (its seal differs)",
                           hint="choose another destination, or delete that checkpoint first")


def uncommit_copy(layout: "_Copied", source: CopySource, dst: Storage) -> None:
    """The commit files first, then the seal (a copy of this very checkpoint, damaged: it
    reads as incomplete to the stack from the first delete on)."""
    for key in [*layout.commit_files, SEAL]:
        dst.delete(key)


def commit_copy(layout: "_Copied", source: CopySource, dst: Storage, published: Sequence[str] = ()) -> None:
    """The stack's commit files were copied last; the seal, when the source has one, joins
    them (written only if absent: a copy of this very checkpoint may have written it)."""
    if isinstance(source.record, bytes) and not dst.write_if_absent(SEAL, source.record) \
            and dst.read(SEAL, max_size=MAX_SEAL_BYTES) != source.record:
        raise RefusedForSafety(f"{dst.url_of(SEAL)} already exists and is another checkpoint's seal; "
                               "another writer is writing here",
                               hint="let the other writer finish, then check the result with `ckptctl verify`")


def pointer_after_copy(layout: "_Copied", source: CopySource) -> tuple[str, bytes] | None:
    return layout.pointer_for(source.name, source.step)


class StackCopying:
    """The copying section of ``layouts.base.Layout`` for the built-in layouts of other tools,
    by the functions above."""

    def copy_source(self, ckpt: Storage) -> CopySource:
        return copy_source(self, ckpt)  # type: ignore[arg-type]

    def copy_committed(self, source: CopySource, dst: Storage) -> AtDestination:
        return copy_committed(self, source, dst)  # type: ignore[arg-type]

    def uncommit_copy(self, source: CopySource, dst: Storage) -> None:
        uncommit_copy(self, source, dst)  # type: ignore[arg-type]

    def commit_copy(self, source: CopySource, dst: Storage, published: Sequence[str] = ()) -> None:
        commit_copy(self, source, dst, published)  # type: ignore[arg-type]

    def pointer_after_copy(self, source: CopySource) -> tuple[str, bytes] | None:
        return pointer_after_copy(self, source)  # type: ignore[arg-type]
