"""Committing and removing one checkpoint of ckptctl's own format.

Nothing a marker commits is ever replaced: every file of a commit is published only under a
name nothing has yet (``Storage.write_if_absent``, ``Writer.publish``), and a name another
attempt at the step already took makes us publish under our attempt's name instead
(``layout.attempt_name``), recorded in the manifest (shards) or the marker (the manifest).
Files of other attempts that the manifest does not name (a dead save's leftovers, a loser's
file published just before it lost) are ignored by every reader and deleted with the step.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

from ckptctl.errors import InvalidCheckpoint, NotFound, RefusedForSafety, StorageError
from ckptctl.format.layout import MANIFEST, MARKER, attempt_name, is_manifest_name, new_save_id, step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import Marker
from ckptctl.layouts.native_read import Committed, dir_step, read_state
from ckptctl.layouts.removal import remove_unchanged
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")


def check_target_name(ckpt: Storage, step: int) -> None:
    """Refuse to write step ``step`` into a directory named for another step: the result
    would be corrupt (its identity would not hold), or worse, taken for that other step."""
    named = dir_step(ckpt)
    if named is not None and named != step:
        raise RefusedForSafety(
            f"{ckpt.url} is the directory of step {named}; refusing to write step {step} into it",
            hint=f"write it to a directory named {step_dir(step)}, or give the root as the "
            "destination (the step's directory is made below it)",
        )


def commit(ckpt: Storage, manifest: Manifest, *, published: Sequence[str] = ()) -> str:
    """Commit ``ckpt`` once every shard is durable: the manifest, then the marker, each
    published only where nothing has its name, so nothing of a committed step is ever
    replaced. The manifest goes to ``manifest.json``, or to ``manifest.<save id>.json`` when
    another attempt at this step took that name (the marker then names it). Returns the
    manifest's name.

    When the marker is there already, or another writer's lands first, raises
    RefusedForSafety naming the URL, leaving that writer's files untouched; first this save's
    own files are deleted by their exact names (its manifest and ``published``, the shards it
    published with ``Writer.publish``), except any the winner's manifest names: a copy may have
    found one of them holding its own bytes and used it (``ops.transfer.engine``)."""
    step = manifest.step
    check_target_name(ckpt, step)
    # No look at the marker first: on object storage it was a round trip after the last
    # shard on every save. The conditional writes decide the step; a writer that lost it (a
    # zombie) learns so at its marker and deletes the manifest it wrote, as below.
    raw = manifest.to_json()
    name = MANIFEST
    if not ckpt.write_if_absent(name, raw):  # another attempt's: never replaced, never deleted
        name = attempt_name(MANIFEST, manifest.save_id or new_save_id())
        if not ckpt.write_if_absent(name, raw):
            _refuse_if_committed(ckpt, step, published)
            # No marker decided the step yet, so nothing of this save is deleted: another
            # writer may be using a shard it published (see ``_discard``).
            raise RefusedForSafety(
                f"{ckpt.url}: {MANIFEST} and {name} both exist; this save of step {step} was not committed",
                hint="another writer is saving this step under the same save id; stop the other job",
            )
    marker_raw = Marker.for_manifest(step, raw, name).to_json()
    if not ckpt.write_if_absent(MARKER, marker_raw):
        if _holds(ckpt, MARKER, marker_raw):
            return name  # ours after all: a retried request that had landed the first time
        _discard(ckpt, [*published, name])
        raise _other_writer(ckpt, step)
    return name


def commit_copy(ckpt: Storage, source: Committed, published: Sequence[str] = ()) -> None:
    """Commit a copy with the exact bytes of another checkpoint's manifest (under the name its
    marker gives) and marker, once every file it names is in place and proven: the manifest,
    then the marker, each written only where nothing has its name. A name that already holds
    exactly these bytes is this checkpoint's (a copy of it run again, or two at once), so a
    copy of the same checkpoint that finds it committed succeeds too. A manifest this copy
    wrote before its data (``manifest_ahead``: its name is in ``published``) is not written
    again: only the marker follows the data.

    Raises RefusedForSafety when another writer took the step: its marker is there or lands
    first (then the files this copy ``published`` that the winner's manifest does not name are
    deleted), or the manifest's name holds other bytes (nothing is deleted then: no marker has
    decided the step yet, and another writer may be using what this copy published)."""
    step = source.manifest.step
    check_target_name(ckpt, step)
    name = source.marker.manifest_name
    # A manifest found in place (not ``published``) is written again if absent: the copy that
    # wrote it may have taken it back since (its source failed its checksums).
    wrote_now = name not in published and _place_manifest(ckpt, source, published)
    if not ckpt.write_if_absent(MARKER, source.marker_raw):
        if _holds(ckpt, MARKER, source.marker_raw) and _holds(ckpt, name, source.manifest_raw):
            return  # this very checkpoint, committed by another copy of it (or an earlier run)
        _discard(ckpt, [*published, name] if wrote_now else published)  # a manifest found in place is not ours
        raise _other_writer(ckpt, step)


def manifest_ahead(ckpt: Storage, source: Committed) -> bool:
    """A copy's manifest, written before its data: without a marker it commits nothing (every
    reader takes the step as partial), so only the marker is left to follow the data
    (``commit_copy``). Written only where nothing has its name; True when this call wrote it,
    False when the name already holds exactly these bytes (an interrupted copy of this
    checkpoint, or another running: never this copy's to delete). Raises RefusedForSafety when
    it holds other bytes, before a byte of data is sent."""
    check_target_name(ckpt, source.manifest.step)
    if ckpt.write_if_absent(source.marker.manifest_name, source.manifest_raw):
        return True
    if _holds(ckpt, source.marker.manifest_name, source.manifest_raw):
        return False
    raise _manifest_taken(ckpt, source)


def _place_manifest(ckpt: Storage, source: Committed, published: Sequence[str]) -> bool:
    """The manifest at commit, only if absent: True when this call wrote it, False when it held
    these bytes already; a name holding other bytes refuses (see ``commit_copy``)."""
    name = source.marker.manifest_name
    # As in ``commit``, the conditional writes decide, with no look at the marker first.
    if ckpt.write_if_absent(name, source.manifest_raw):
        return True
    if _holds(ckpt, name, source.manifest_raw):
        return False
    _refuse_if_committed(ckpt, source.manifest.step, published)
    raise _manifest_taken(ckpt, source)


def _manifest_taken(ckpt: Storage, source: Committed) -> RefusedForSafety:
    name = source.marker.manifest_name
    return RefusedForSafety(
        f"{ckpt.url_of(name)} already exists and is another checkpoint's manifest: another writer is "
        f"writing step {source.manifest.step} here (or a killed one left it); nothing was replaced and this copy "
        "was not committed",
        hint="let the other writer finish; if none is running, remove the partial step "
        f"(`ckptctl rm {ckpt.url} --force`) and copy again",
    )


def _refuse_if_committed(ckpt: Storage, step: int, published: Sequence[str]) -> None:
    """A manifest name taken: when a marker already decided the step for another writer,
    this writer lost it, so its own files go (``_discard``) and the refusal says who won."""
    if ckpt.stat(MARKER) is not None:
        _discard(ckpt, published)
        raise _other_writer(ckpt, step)


def _holds(ckpt: Storage, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` (read back bounded by its length)."""
    try:
        with ckpt.open_reader(key) as r:
            return r.size == len(data) and r.read(0, r.size) == data
    except (NotFound, InvalidCheckpoint):
        return False


def _discard(ckpt: Storage, names: Iterable[str]) -> None:
    """After losing the step to another writer's marker, delete the files this writer
    published (``names``, exact), except those the winner's committed manifest names: a copy
    that found one of them holding exactly its own bytes used it instead of writing its own
    (``ops.transfer.engine``), so deleting it would break the committed checkpoint. When the
    winner's commit cannot be read, nothing is deleted. A failure is logged, not raised: the
    refusal is the outcome that matters, and a file left behind is not named by the winner's
    manifest, so it is harmless."""
    state = read_state(ckpt)
    if state.committed is None:
        log.warning("%s: the other writer's commit cannot be read (%s); this writer's files are left", ckpt.url, state.error)
        return
    kept = {state.committed.marker.manifest_name, *(f.name for f in state.committed.manifest.files)}
    for name in names:
        if name in kept:
            continue
        try:
            ckpt.delete(name)
        except (StorageError, InvalidCheckpoint) as e:
            log.warning("could not delete %s after losing the step to another writer: %s", ckpt.url_of(name), e)


def _other_writer(ckpt: Storage, step: int) -> RefusedForSafety:
    return RefusedForSafety(
        f"{ckpt.url_of(MARKER)} already exists: another writer committed step {step} here; "
        "this one's marker was not written",
        hint="two jobs are saving into one root (a zombie job and its restart?); stop the other "
        "one and check this step with `ckptctl verify`",
    )


def uncommit(ckpt: Storage) -> None:
    """Remove the marker only: the checkpoint reads as partial from then on."""
    ckpt.delete(MARKER)


def removal_order(keys: Iterable[str]) -> list[str]:
    """Keys in the order a delete takes them: the marker, then the manifest(s), then the rest,
    so that a delete cut short leaves something that reads as partial, never as committed."""
    return sorted(keys, key=lambda k: (0 if k == MARKER else 1 if is_manifest_name(k) else 2, k))


def remove(ckpt: Storage, *, expected: Mapping[str, tuple[int, float]] | None = None) -> str | None:
    """Delete one checkpoint: the marker first, so that a removal interrupted at any point
    leaves something that reads as partial, never as committed; then the manifest, the rest
    and the directory (when empty).

    With ``expected`` (key -> (size, mtime), as a prune plan saw them) only those files are
    deleted, each only while unchanged (the marker and the manifest one at a time, then the
    rest several at once: ``layouts.removal``): the URL of the first that changed is returned,
    and it stays. Returns None when everything asked for was deleted.
    """
    if expected is not None:
        return remove_unchanged(ckpt, removal_order(expected), expected, (MARKER, MANIFEST))
    uncommit(ckpt)
    for info in list(ckpt.list()):
        ckpt.delete(info.key)
    ckpt.remove_dir("")
    return None
