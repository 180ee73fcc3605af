"""The one copy engine: ``cp``, ``restore``, ``sync`` and tier promotion copy a checkpoint of
any layout through it, driven by what the checkpoint's layout says (``Layout.copy_source``: the
files in writing order, what proves each one, the commit record, the pointer). Nothing here
asks who wrote a checkpoint.

One copy (``copy_in_layout``), in order:

1. the source's record is read once (by rank 0 under torchrun, and sent to every rank); a
   layout that asks for it has its source checked at ``check_before`` before a byte is copied;
2. the destination is judged by the layout (``copy_committed``): this very checkpoint committed
   there is proven file by file ("already present"; a damaged file of it is replaced once its
   commit record is gone); another checkpoint is refused, never replaced. Beside that verdict
   the copy asks its own first questions (``first_look``: the open uploads of its keys aborted,
   the names taken listed), unless the caller expects the checkpoint there (a ``sync``
   over a mirror that lists it), and writes the part of its record that commits nothing alone
   (``Layout.copy_ahead``: ckptctl's manifest), so that only the rest follows the data;
3. every data file is streamed from the source, checked against its proof on the way
   (``copy_files``), and published only where nothing has its name (``Writer.publish``: a link
   locally, ``If-None-Match: *`` on S3); a name already taken is used as it is when it holds
   exactly this file's bytes, proven the same way (an interrupted copy run again, a retried
   promotion round: they resume), and is otherwise refused for safety, never replaced;
4. the commit files the same way, once every data file of every rank is in;
5. the layout commits (``commit_copy``: the rest of its record last, only where nothing has its name); a
   copy that lost the step to another writer's commit deletes what it published that the
   winner does not name, and is refused for safety; a layout that asks for it has its copy
   checked at ``check_after`` (an unsealed checkpoint of another tool is test-loaded), and a
   copy that fails it is taken back, commit files first;
6. the stack's pointer, last, never moved to an older step.

What a copy deletes: only files it published itself, by their exact names. A copy refused for
safety before any commit decided the step deletes nothing (another writer may have found a file
of it holding exactly its own bytes and used it) but what it wrote ahead of the data, as does a
copy failing for any reason before its commit (a copy of the same checkpoint that used it
writes it again at its commit); one that lost to another writer's commit
deletes what the winner does not name; one whose source turns out corrupt takes back what it
published (``docs/protocol.md``, "Every writer of a step"). What an interrupted copy leaves is
partial (no commit record) and reused by the next copy of the same checkpoint, or removed with
the step by prune's partial rule.

Files are copied by ``ops.transfer.files`` (its memory bound holds per rank).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Literal, TypeVar

from ckptctl.errors import InvalidCheckpoint, RefusedForSafety
from ckptctl.layouts.base import Layout
from ckptctl.layouts.copying import CopySource, ToCopy
from ckptctl.ops.distributed import Job, agree, attempt, current, everyone, gathered, mine, on_root
from ckptctl.ops.seal.leftovers import remove_temporaries
from ckptctl.ops.transfer.files import Copied, Ends, at_destination, copy_files, describe_problems, proven_at
from ckptctl.ops.transfer.first_look import first_look, withdraw
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.ops.verify.engine import verify
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS
from ckptctl.storage import open_storage
from ckptctl.storage.base import Storage

CopyStatus = Literal["copied", "already present"]
T = TypeVar("T")


@dataclass
class CopyResult:
    src: str
    dst: str
    step: int
    status: CopyStatus
    files: int = 0
    bytes_copied: int = 0
    files_reused: int = 0  # already in place holding their proven bytes (an interrupted copy re-run)
    seconds: float = 0.0
    layout: str = "ckptctl"  # whose checkpoint
    note: str | None = None  # how another tool's checkpoint was checked, and its pointer
    # Under torchrun: what each rank (cp) or node (restore) copied; empty otherwise.
    ranks: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.ranks:  # a plain run's document is unchanged
            del d["ranks"]
        return d


# --- one checkpoint ---------------------------------------------------------------------------


def copy_in_layout(layout: Layout, src: Storage, into: Storage, *, into_root: bool = True,
                   progress: Progress | None = None, threads: int = COPY_THREADS,
                   vouched: Callable[[Storage], bool] | None = None, expect_present: bool = False) -> CopyResult:
    """Copy the committed checkpoint ``src`` of ``layout`` into ``into``: a root, where the copy
    takes the checkpoint's name (``into_root``), or the copy's own path (its parent is then the
    root, where a pointer goes), in the order of this module's docstring. ``vouched``: a
    cheaper proof that a committed copy of this very checkpoint is whole (``sync``: the
    verification record). ``expect_present``: the caller saw it at the destination, so the
    copy asks for the layout's verdict alone before its own first questions (``first_look``).

    Raises NotFound (src not committed), InvalidCheckpoint (src corrupt, or the copy does not
    check out: nothing is committed at the destination), RefusedForSafety (it holds another
    checkpoint, another writer took the step, or a name there holds other bytes) or
    StorageError.

    Under a torchrun verb (``ops.distributed.current``; the destination shared by the ranks)
    each rank copies its share of the data files, balanced by bytes; rank 0 copies the commit
    files and commits once every rank's files are in, and every rank returns the same result or
    raises the same error."""
    t0 = time.perf_counter()
    job = current()
    source = on_root(job, lambda: layout.copy_source(src))  # one read of the record, sent to every rank
    if into_root:
        dst, dst_root, name = into.sub(source.name), into, source.name
    else:
        dst, dst_root, name = into, parent_of(into), into.url.rstrip("/").rsplit("/", 1)[-1]
    ends = Ends(src, dst, dst_root, name)
    result = CopyResult(src.url, dst.url, source.step, "copied", files=len(source.files), layout=layout.name,
                        note=source.note)
    if source.check_before is not None:  # every rank calls it: the verify engine splits or shares the work
        problems = verify(src, layout, source.check_before).problems
        if problems:
            raise InvalidCheckpoint(describe_problems(problems, src.url), hint=problems[0].hint or "copy an older checkpoint")
    todo, result.note, taken, ahead = _at_hand(layout, source, ends, job, vouched, result.note, ahead=not expect_present)
    if todo is not None and not todo:
        result.status = "already present"
        _finish(lambda: layout.commit_copy(source, dst), dst, job)  # a record part a killed copy never wrote (a seal)
        if source.check_after is not None:
            _check_after(layout, source, ends, None, job)
    else:
        files = [f for f in source.files if todo is None or f.name in todo]
        copied = _copy_all(layout, source, ends, files, progress, threads, job, taken, ahead)
        result.bytes_copied = sum(c.bytes_copied for c in copied if c is not None)
        result.files_reused = sum(c.reused for c in copied if c is not None) + len(source.files) - len(files)
        if job is not None:
            result.ranks = [{"rank": r, "node": job.nodes[r], "files": c.files if c else 0, "bytes": c.bytes_copied if c else 0}
                            for r, c in enumerate(copied)]
    _finish(lambda: _write_pointer(layout, replace(source, name=name), dst_root, result), dst, job)
    result.seconds = time.perf_counter() - t0
    return result


def parent_of(st: Storage) -> Storage:
    """The storage of the directory (or prefix) holding ``st``."""
    local = st.local_path()
    if local is not None:
        return open_storage(os.path.dirname(os.path.abspath(local)))
    url = st.url.rstrip("/")
    head, _, _ = url.rpartition("/")
    return open_storage(head if "/" in url.split("://", 1)[-1] else url)


def _whole(source: CopySource) -> bool:
    """Whether the checkpoint is one file (written into its root under its name)."""
    return any(not f.name for f in source.files)


def _at_hand(layout: Layout, source: CopySource, ends: Ends, job: Job | None,
             vouched: Callable[[Storage], bool] | None,
             note: str | None, *,
             ahead: bool) -> tuple[set[str] | None, str | None, frozenset[str] | None, tuple[str, ...]]:
    """What the destination already holds: None when it commits nothing (every file is to be
    copied; those already in place and proven are kept as they go), else the names of the files
    still to copy (none when this checkpoint is there whole: "already present"); the note of
    the copy, saying so when a copy there was damaged; the keys taken there when the first
    look listed them (``first_look``: the open uploads of those keys are aborted then too); and
    the record's keys it wrote ahead of the data (``Layout.copy_ahead``). A
    damaged copy of this very checkpoint loses its record, then its damaged files, before they
    are copied again; anything else committed there is refused."""
    dst = ends.dst
    if dst.local_path() is not None and not _whole(source):
        # A copy killed mid-file left temporaries: removed before anything is decided, so a
        # rerun neither counts them as files of the copy nor leaves them for verify to trip on.
        on_root(job, lambda: at_destination(dst, lambda: remove_temporaries(dst)))
    look = on_root(job, lambda: at_destination(dst, lambda: first_look(layout, source, ends, ahead=ahead)))
    there = look.there
    if there == "nothing":
        return None, note, look.names, look.ahead
    if vouched is not None and on_root(job, lambda: vouched(dst)):
        return set(), note, None, ()
    # Every byte, not just sizes and headers: a flipped byte in a copy trusted as "already
    # there" would be handed to training. The files are split over the ranks by bytes.
    share = [source.files[i] for i in mine(job, [f.size for f in source.files])]
    bad, failure = attempt(lambda: at_destination(dst, lambda: [f.name for f in share if not proven_at(ends, f)]))
    damaged = {name for names in gathered(job, bad, failure) for name in (names or [])}
    if not damaged:
        return set(), note, None, ()
    if there != "this":
        what = "another file under this checkpoint's name" if _whole(source) else \
            f"a {layout.name} checkpoint ({sorted(damaged)[0]} differs from the source)"
        raise RefusedForSafety(f"{dst.url} already holds {what}",
                               hint="choose another destination, or delete that checkpoint first")

    def take_damaged_back() -> None:  # this very checkpoint, damaged: its record first, then its bad files
        layout.uncommit_copy(source, dst)
        for item in source.files:
            if item.name in damaged:
                where, key = ends.at(item)
                where.delete(key)

    _finish(take_damaged_back, dst, job)
    first = sorted(damaged)[0]
    said = f"the copy at {dst.url} failed verification ({first or ends.name} does not hold its bytes); copied again"
    # Uncommitting may have removed the commit files too (another tool's): they are copied again.
    return damaged | {f.name for f in source.files if f.commit}, f"{note}; {said}" if note else said, None, ()


def _copy_all(layout: Layout, source: CopySource, ends: Ends, files: list[ToCopy], progress: Progress | None,
              threads: int, job: Job | None, taken: frozenset[str] | None,
              ahead: tuple[str, ...]) -> list[Copied | None]:
    """Copy ``files`` (``_copy_data``), commit, and check the copy when the layout asks;
    returns what each rank copied. ``taken``: the keys the first look found at the destination
    (its uploads of them aborted already); ``ahead``: the record's keys it wrote (rank 0's)."""
    mine_ahead = list(ahead) if job is None or job.rank == 0 else []
    try:
        copied, published = _copy_data(source, ends, files, progress, threads, job, taken, mine_ahead)
    except BaseException:
        # Before its commit a copy's record commits nothing: what it wrote ahead goes (a
        # corrupt source's take-back did it already). Not once the marker may have landed.
        withdraw(ends.dst, mine_ahead)
        raise
    dst = ends.dst
    _finish(lambda: layout.commit_copy(source, dst, published), dst, job)  # the rest of the record, only if absent
    if source.check_after is not None:
        _check_after(layout, source, ends, published, job)
    return copied


def _copy_data(source: CopySource, ends: Ends, files: list[ToCopy], progress: Progress | None, threads: int,
               job: Job | None, taken: frozenset[str] | None,
               ahead: list[str]) -> tuple[list[Copied | None], list[str]]:
    """The data files split over the ranks, then the commit files on rank 0: what each rank
    copied, and every key this copy published, ``ahead`` first. A corrupt source is taken back."""
    dst = ends.dst
    place = ends.at(source.files[0])[0] if source.files else dst

    def clear() -> None:  # a killed earlier run's uploads
        at_destination(dst, lambda: before_copy(place, [ends.at(f)[1] for f in files]))

    if job is not None and taken is None:  # once, on rank 0, before any rank writes
        _finish(clear, dst, job)
    data = [f for f in files if not f.commit]
    share = [data[i] for i in mine(job, [f.size for f in data])]
    done, failure = attempt(lambda: copy_files(ends, share, progress, threads=threads, taken=taken,
                                               before_writing=clear if job is None and taken is None else None))
    copied = gathered(job, done, failure)
    if any(c is not None and c.problems for c in copied):
        assert done is not None
        _take_back(ends, [*ahead, *done.published], job, not _whole(source))  # each rank its own files
        _raise_problems([c for c in copied if c is not None], ends.src)
    published = [*ahead, *(name for c in copied if c is not None for name in c.published)]
    last: Copied | None = Copied()
    if job is None or job.rank == 0:
        last, failure = attempt(lambda: copy_files(ends, [f for f in files if f.commit], progress, threads=1, taken=taken))
    agree(job, failure)
    last = everyone(job, last)[0] if job is not None else last  # rank 0's, on every rank
    assert last is not None
    if last.problems:
        _take_back(ends, [*published, *last.published] if job is None or job.rank == 0 else [], job, not _whole(source))
        _raise_problems([last], ends.src)
    copied[0] = _merged(copied[0], last)
    return copied, [*published, *last.published]


def _take_back(ends: Ends, published: list[str], job: Job | None, directory: bool) -> None:
    """A corrupt source: each rank deletes the files it published (by their exact names: never
    another writer's), then the directory goes when nothing else is in it."""
    where = ends.dst_root if not directory and ends.dst_root is not None else ends.dst
    _, failure = attempt(lambda: at_destination(ends.dst, lambda: [where.delete(name) for name in published]))
    agree(job, failure)  # every rank's files are gone before the directory is removed
    if directory:
        _finish(lambda: ends.dst.remove_dir(""), ends.dst, job)  # only if now empty; a no-op on S3


def _raise_problems(copied: list[Copied], src: Storage) -> None:
    """A corrupt source: InvalidCheckpoint naming the most precise problem."""
    problems = [p for c in copied for found in c.problems.values() for p in found]
    if not problems:
        return
    hint = (problems[0].hint or "copy an older checkpoint") if any(c.before_copy for c in copied) \
        else "the source was modified after it was written; copy an older checkpoint"
    raise InvalidCheckpoint(describe_problems(problems, src.url), hint=hint)


def _merged(a: Copied | None, b: Copied) -> Copied:
    if a is None:
        return b
    a.published += b.published
    a.files, a.reused, a.bytes_copied = a.files + b.files, a.reused + b.reused, a.bytes_copied + b.bytes_copied
    return a


def _check_after(layout: Layout, source: CopySource, ends: Ends, published: list[str] | None, job: Job | None) -> None:
    """The copy as ``verify`` will judge it, as its stack will read it once the pointer names
    it, so that neither "copied" nor "already present" is said of a copy that does not verify
    (nor its pointer written). A copy that fails is taken back (its record and commit files
    first, then what it ``published``); one found already there (``published`` None) is left
    as it is."""
    dst_root = ends.dst_root
    assert dst_root is not None and source.check_after is not None
    bound = layout.for_root(dst_root).assuming_pointer(ends.name, source.step)
    checked = dst_root.sub(ends.name) if _whole(source) else ends.dst
    problems = verify(checked, bound, source.check_after).problems
    if not problems:
        return
    what = "the copy, test-loaded" if source.check_after == "load" else "the copy, verified"
    fail = InvalidCheckpoint(describe_problems(problems, f"{checked.url} ({what})"),
                             hint="the source does not load either, or changed while copied; copy an older checkpoint")
    if published is None:
        raise fail

    def take_back() -> None:
        if not _whole(source):
            layout.uncommit_copy(source, ends.dst)
        files = {ends.at(item)[1] for item in source.files}
        withdraw(ends.dst, [key for key in published if key not in files])  # the record's keys written ahead
        for item in source.files:
            where, key = ends.at(item)
            if key in published:
                where.delete(key)
        if not _whole(source):
            ends.dst.remove_dir("")  # only if now empty

    _finish(take_back, ends.dst, job)
    raise fail


def _write_pointer(layout: Layout, source: CopySource, dst_root: Storage, result: CopyResult) -> None:
    """The stack's pointer at the destination root, last, never moved to an older step: written
    only over the content it was judged by (``compare_and_swap``), so a pointer another copy
    moved meanwhile (to a newer step) is judged again, never undone."""
    pointer = layout.pointer_after_copy(source)
    if pointer is None:
        return
    key, content = pointer
    info = dst_root.stat(key)
    if info is not None and info.kind != "file":
        result.note = f"{result.note}; {key} at the destination is unreadable, left as is"
        return
    current = None if info is None else dst_root.read(key, max_size=4096)
    for _attempt in range(_POINTER_TRIES):
        if current is not None:
            current_step = layout.pointer_step(current)
            if current_step is None:
                result.note = f"{result.note}; {key} at the destination is unreadable, left as is"
                return
            if current_step >= source.step:
                if current_step > source.step:
                    result.note = f"{result.note}; {key} at the destination names a newer step ({current_step}), left as is"
                return
        found = dst_root.compare_and_swap(key, current, content)
        if found == current:
            result.note = f"{result.note}; {key} written last"
            return
        current = found  # moved by another writer since it was read
    result.note = f"{result.note}; {key} at the destination kept changing while written, left as is"


# Each retry means another writer moved the pointer in between; a few cover any real race.
_POINTER_TRIES = 5


def _finish(fn: Callable[[], T], dst: Storage, job: Job | None) -> T:
    """``fn`` on rank 0 (alone without torchrun), its failure or result given to every rank."""
    value, failure = (None, None)
    if job is None or job.rank == 0:
        value, failure = attempt(lambda: at_destination(dst, fn))
    agree(job, failure)
    return everyone(job, value)[0] if job is not None else value  # type: ignore[return-value]
