"""``cp`` and ``restore`` of other tools' checkpoints (Hugging Face Trainer, torchtitan/DCP,
Megatron-LM, DeepSpeed), between a filesystem and object storage.

Every file is copied through the destination's atomic writers, in the order that keeps the
destination unusable until it is whole:

1. the stack's data files;
2. the files its commit rule reads (``trainer_state.json``, ``.metadata``, ...: the layout's
   ``commit_files``), so a copy cut short reads as an incomplete checkpoint to the stack;
3. the seal, when the source has one;
4. for stacks committed by a pointer at the root (DeepSpeed ``latest``, Megatron
   ``latest_checkpointed_iteration.txt``), the pointer, written last and only when the
   destination root has none or one naming an older step: a restore never moves a
   destination's pointer backwards (an older copy is still complete by those stacks' rules,
   which take every step at or below the pointer's).

Checking: a sealed source (``ckptctl seal``) is checked on the fly, each byte against the seal
as it is copied, so a corrupt source commits nothing; this works from and to object storage.
Without a seal there is nothing to check bytes against, so the copy is test-loaded at the
destination (every file, as ``verify --load`` does) before its commit files stay and its
pointer is written; on object storage that streams each file back to a temporary local file,
so sealing first (the seal travels with the copy, and each byte is checked on the way) saves
that read. Layouts read through ``Storage``, so a checkpoint is recognised by its own files on
every backend; a prefix holding only a seal of a layout is recognised by the seal.

Before a byte is copied the source passes the quick level of ``verify`` (the stack's commit rule,
each file's own header: a safetensors file with trailing bytes or a torch zip whose members do
not add up is refused at once, not after copying it). A copy run again after a kill first removes
the temporaries the killed run left (``ops.seal.leftovers``), and the destination is checked as
``verify`` will judge it before the pointer is written and "copied" is reported.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterator, cast

from ckptctl.errors import InvalidCheckpoint, NoValidCheckpoint, NotFound, RefusedForSafety
from ckptctl.format.seal import SEAL, Seal
from ckptctl.layouts.catalog import NATIVE, newest_marked, other_tools_committed
from ckptctl.layouts.classify import Found, classify
from ckptctl.layouts.stack import StackLayout
from ckptctl.layouts.registry import layout_named
from ckptctl.ops.verify.engine import verify
from ckptctl.ops.seal.leftovers import remove_temporaries
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.seal_check import check_against_seal, compare, hash_object, read_seal
from ckptctl.ops.transfer.copy import CopyResult, RestoreResult, Skipped
from ckptctl.layouts.checked import Level
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS
from ckptctl.storage import open_storage
from ckptctl.storage.base import ObjectInfo, Storage

CHECKED_SEAL = "every byte checked against the source's seal on the fly"
CHECKED_LOAD = "no seal: copied, then every file test-loaded at the destination (no checksums to check bytes against)"


@dataclass
class StackSource:
    """One checkpoint of another tool, ready to copy."""

    storage: Storage
    name: str
    layout: StackLayout  # bound to the source root when it is local
    step: int
    seal: Seal | None
    seal_raw: bytes | None = None


def stack_source(found: Found) -> StackSource | None:
    """The other tool's checkpoint ``found`` is (``layouts.classify``: by its name under its
    root, or on object storage by its seal), ready to copy; None for ckptctl's own, a file
    format, nothing, or a checkpoint whose name gives no step (a DCP directory named alone:
    nothing says which step it is under a destination root)."""
    if found.what != "checkpoint" or found.file_format() == "ckptctl":
        return None
    step = found.step
    if step is None:
        return None
    layout = cast(StackLayout, found.in_layout)
    if layout.files_are_checkpoints:
        return StackSource(found.storage, found.name, layout, step, None)  # copied whole: ``file_copy.copy_stack_file``
    ckpt = found.storage
    seal = read_seal(ckpt)
    return StackSource(ckpt, found.name, layout, step, seal, ckpt.read(SEAL) if seal is not None else None)


def stack_source_at(path: str) -> StackSource | None:
    """``stack_source(classify(path))``."""
    return stack_source(classify(path))


def _parent(st: Storage) -> Storage:
    url = st.url.rstrip("/")
    return open_storage(url.rsplit("/", 1)[0] if "/" in url.split("://", 1)[-1] else url)


def destination_for(src: StackSource, dst: str) -> tuple[Storage, Storage]:
    """(checkpoint directory, its root) for ``cp``: DST itself when it is named like one of the
    layout's checkpoints, else a directory of the source's name under DST."""
    st = open_storage(dst)
    last = dst.rstrip("/").rsplit("/", 1)[-1]
    if src.layout.step_of(ObjectInfo(last, 0, 0.0, "dir")) is not None:
        return st, _parent(st)
    return st.sub(src.name), st


def source_problems(src: StackSource) -> list[Problem]:
    """The cheap checks before a byte is copied: the stack's commit rule and files, and the
    files and sizes the seal names when there is one (``verify`` at quick)."""
    return list(verify(src.storage, src.layout, "quick").problems)


def describe(problems: list[Problem], where: str) -> str:
    first = min(problems, key=lambda p: p.byte_range is None)
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {first}{more}"


def _already_present(src: StackSource, dst: Storage) -> bool:
    """True when ``dst`` holds this very checkpoint (same seal, every byte matching it; or a
    copy killed before its seal was written, every byte matching the source's seal, which is
    then written). A destination holding a commit file of anything else is refused, never
    overwritten."""
    committed = [k for k in src.layout.commit_files if dst.stat(k) is not None]
    if not committed:
        return False  # nothing, or a copy cut short before its commit files: redone
    if src.seal is not None and src.seal_raw is not None:
        dst_seal = dst.stat(SEAL)
        if (dst_seal is None or dst.read(SEAL, max_size=64 << 20) == src.seal_raw) and \
                not check_against_seal(dst, src.seal, "checksums")[0]:
            if dst_seal is None:
                dst.write_if_absent(SEAL, src.seal_raw)
            return True
    elif src.seal is None and _same_files(src.storage, dst):
        return True
    raise RefusedForSafety(f"{dst.url} already holds a {src.layout.name} checkpoint ({committed[0]} is there)",
                           hint="choose another destination, or delete that checkpoint first")


def _same_files(a: Storage, b: Storage) -> bool:
    """Both hold the same files with the same bytes (an unsealed copy run again: read both)."""
    files_a = {i.key: i.size for i in a.list() if i.key != SEAL}
    if files_a != {i.key: i.size for i in b.list() if i.key != SEAL}:
        return False
    for key in files_a:
        ha, hb = hash_object(a, key, 64 << 20), hash_object(b, key, 64 << 20)
        if ha is None or hb is None or ha.xxh3 != hb.xxh3:
            return False
    return True


def copy_stack_checkpoint(src: StackSource, dst: Storage, dst_root: Storage, progress: Progress | None = None, *,
                          threads: int = COPY_THREADS) -> CopyResult:
    """Copy one checkpoint of another tool to ``dst`` (its directory) under ``dst_root`` (where a
    pointer goes), in the order and with the checks of this module's docstring.

    Raises InvalidCheckpoint (the source is incomplete or does not check out: the files this
    call wrote are removed), RefusedForSafety (``dst`` holds another checkpoint), UsageError
    (an unsealed checkpoint to object storage) or StorageError."""
    t0 = time.perf_counter()
    result = CopyResult(src.storage.url, dst.url, src.step, "copied", layout=src.layout.name,
                        note=CHECKED_SEAL if src.seal is not None else CHECKED_LOAD)
    problems = source_problems(src)
    if problems:
        raise InvalidCheckpoint(describe(problems, src.storage.url), hint=problems[0].hint or "copy an older checkpoint")
    # A copy killed mid-file left temporaries here: removed before anything is decided, so a
    # rerun neither counts them as files of the copy nor leaves them for verify to trip on.
    remove_temporaries(dst)
    if _already_present(src, dst):
        result.status = "already present"
        _check_destination(src, dst, dst_root)
        _write_pointer(src, dst_root, result)
        result.seconds = time.perf_counter() - t0
        return result
    keys = sorted(i.key for i in src.storage.list() if i.key != SEAL)
    if src.seal is not None and set(keys) != set(src.seal.by_name()):
        raise InvalidCheckpoint(f"{src.storage.url}: its files differ from its seal", hint="verify it: `ckptctl verify SRC`")
    commit = [k for k in src.layout.commit_files if k in keys]
    order = [k for k in keys if k not in commit] + commit
    result.files = len(order)
    try:
        # Data files in parallel (on S3 each is a request of its own), then the commit files.
        result.bytes_copied = _copy_all(src, dst, [k for k in order if k not in commit], progress, threads)
        result.bytes_copied += _copy_all(src, dst, commit, progress, 1)
        if src.seal is not None and src.seal_raw is not None:
            dst.write_atomic(SEAL, src.seal_raw)
        _check_destination(src, dst, dst_root)
    except InvalidCheckpoint:
        for key in commit + order:  # commit files first: never something that reads as complete
            dst.delete(key)
        dst.remove_dir("")
        raise
    _write_pointer(src, dst_root, result)
    result.seconds = time.perf_counter() - t0
    return result


def _copy_all(src: StackSource, dst: Storage, keys: list[str], progress: Progress | None, threads: int) -> int:
    """Copy ``keys``, ``threads`` at a time; the first file that fails its check stops the
    others at their next piece and is raised. Returns the bytes copied."""
    stop = threading.Event()

    def one(key: str) -> int:
        try:
            return _copy_one(src, dst, key, progress, stop)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptctl-copy") as pool:
        futures: list[Future[int]] = [pool.submit(one, k) for k in keys]
        try:
            wait(futures)
        except BaseException:
            stop.set()  # Ctrl-C: the workers abort their writers at the next piece
            for f in futures:
                f.cancel()
            raise
    return sum(f.result() for f in futures)  # the first failure, in key order, is raised here


def _copy_one(src: StackSource, dst: Storage, key: str, progress: Progress | None,
              stop: threading.Event | None = None) -> int:
    """Copy one file through an atomic writer, checked against the seal when there is one.
    Returns the bytes copied (0 when ``stop`` was set meanwhile: nothing is committed)."""
    chunk = src.seal.chunk_size if src.seal is not None else 64 << 20
    writer = dst.open_writer(key)
    try:
        got = hash_object(src.storage, key, chunk, progress=progress, sink=writer.write, stop=stop)
    except BaseException:
        writer.abort()
        raise
    if got is None:
        writer.abort()
        return 0
    if src.seal is not None:
        found = compare(src.seal.by_name()[key], got, chunk)
        if found:
            writer.abort()
            raise InvalidCheckpoint(describe(found, src.storage.url),
                                    hint="the source changed after it was sealed; copy an older checkpoint")
    writer.commit()
    return got.size


def _check_destination(src: StackSource, dst: Storage, dst_root: Storage) -> None:
    """The destination as ``verify`` will judge it, as the stack will read it once the pointer
    (if any) names it: the last step before the pointer, so that "copied" is never said of a
    copy that does not verify. Unsealed: every file test-loaded (there is nothing else to check
    bytes against). Sealed: the bytes were checked against the seal on the way, so the stack's
    commit rule and files and the seal's list of files and sizes (nothing added, as a leftover
    of a killed copy would be). On object storage the test-load streams each file to a
    temporary local file (``storage.stored_file.local_copy``): a sealed copy avoids that."""
    layout = layout_named(src.layout.name, dst_root).assuming_pointer(src.name, src.step)
    level: Level = "quick" if src.seal is not None else "load"
    problems = verify(dst, layout, level).problems
    what = "the copy, verified" if src.seal is not None else "the copy, test-loaded"
    if problems:
        raise InvalidCheckpoint(describe(problems, f"{dst.url} ({what})"),
                                hint="the source does not load either, or changed while copied; copy an older checkpoint")


def _write_pointer(src: StackSource, dst_root: Storage, result: CopyResult) -> None:
    """The stack's pointer at the destination root, last, never moved to an older step."""
    pointer = src.layout.pointer_for(src.name, src.step)
    if pointer is None:
        return
    key, content = pointer
    info = dst_root.stat(key)
    if info is not None:
        current = src.layout.pointer_step(dst_root.read(key, max_size=4096)) if info.kind == "file" else None
        if current is None:
            result.note = f"{result.note}; {key} at the destination is unreadable, left as is"
            return
        if current >= src.step:
            if current > src.step:
                result.note = f"{result.note}; {key} at the destination names a newer step ({current}), left as is"
            return
    dst_root.write_atomic(key, content)
    result.note = f"{result.note}; {key} written last"


# --- restore -------------------------------------------------------------------------------


def _candidates(root: Storage, step: int | None) -> Iterator[StackSource]:
    """Other tools' complete checkpoint directories under ``root``, newest first."""
    return stack_sources(root, step)


def stack_sources(root: Storage, step: int | None = None, *, with_files: bool = False) -> Iterator[StackSource]:
    """Other tools' complete checkpoints under ``root``, newest first, by each layout's commit
    rule, on every backend; one-file checkpoints (Lightning's) only ``with_files``."""
    entries = [e for e in other_tools_committed(root) if step is None or e.step == step]
    for e in sorted(entries, key=lambda e: (e.step, e.name), reverse=True):
        assert e.storage is not None
        layout = layout_named(e.layout, root)
        if layout.files_are_checkpoints:
            if with_files:
                yield StackSource(e.storage, e.name, layout, e.step, None)
            continue  # a one-file checkpoint (Lightning): copied as a file, not restored here
        seal = read_seal(e.storage)
        yield StackSource(e.storage, e.name, layout, e.step, seal, e.storage.read(SEAL) if seal else None)


def wants_stack_restore(src: Found) -> bool:
    """Whether ``restore`` of ``src`` is one of other tools' checkpoints (one checkpoint of
    another tool, or a root holding no ckptctl checkpoint and some of other tools')."""
    if src.what == "checkpoint":
        return stack_source(src) is not None  # ckptctl's own: ops.transfer.copy restores it
    if next(newest_marked(src.storage, layouts=NATIVE), None) is not None:
        return False  # a root with a ckptctl checkpoint: ops.transfer.copy restores it
    return next(_candidates(src.storage, None), None) is not None


def restore_stack(src: Found, dst_root: Storage, step: int | None = None, progress: Progress | None = None, *,
                  on_skip: Callable[[Skipped], None] | None = None) -> RestoreResult:
    """Copy the newest complete checkpoint of another tool under ``src_root`` (or ``step``)
    into ``dst_root`` under its own name, checked as ``copy_stack_checkpoint`` does; one that
    does not check out is reported through ``on_skip`` and the next newest is tried (with
    ``step`` pinned, it raises instead). ``src`` may be one checkpoint (``layouts.classify``)."""
    src_root = src.storage
    one = stack_source(src)
    cands = iter([one]) if one is not None else _candidates(src_root, step)
    skipped: list[Skipped] = []
    for cand in cands:
        dst = dst_root.sub(cand.name)
        try:
            copied = copy_stack_checkpoint(cand, dst, dst_root, progress)
        except (InvalidCheckpoint, NotFound) as e:
            if step is not None or one is not None:
                raise
            skip = Skipped(cand.storage.url, cand.step, str(e))
            skipped.append(skip)
            if on_skip is not None:
                on_skip(skip)
            continue
        where = dst.local_path() or dst.url
        # What the stack's resume option takes: the checkpoint, or the root for Megatron's --load.
        return RestoreResult(cand.layout.resume(where, cand.step).path, cand.step, copied, skipped)
    what = f"complete checkpoint at step {step}" if step is not None else "complete checkpoint of another tool"
    if skipped:
        raise NoValidCheckpoint(f"{src_root.url}: none of {len(skipped)} {what}s checks out",
                                hint="run `ckptctl verify SRC --all` to see what is wrong with each")
    raise NoValidCheckpoint(f"{src_root.url}: no {what}", hint=f"list what is there with `ckptctl ls {src_root.url}`")
