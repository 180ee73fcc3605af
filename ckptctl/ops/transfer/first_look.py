"""A copy's first look at its destination: the layout's verdict (``Layout.copy_committed``:
is this checkpoint, or another, committed there?) and what the copy asks before its first part
(the open uploads of the files it is about to write, aborted: ``uploads.before_copy``; the
names already taken: ``files.names_there``), all in flight at once, and beside them the part of
the commit record that commits nothing alone (``Layout.copy_ahead``: ckptctl's manifest, whose
marker is still to come), so that only the rest of the record follows the data.

On object storage each is a round trip, and a first part that waited for them one after the
other waited for three (``docs/decisions.md``, "S3: a save's and a copy's requests around the
data"); a record written after the data is a round trip after its last Complete for each file.
The two for the copy are only of use when the verdict is "nothing" (the common case: a copy
into a destination expected empty), so a caller that expects the checkpoint there already
(``sync``, for each checkpoint the mirror's listing shows) asks for the verdict alone, and
writes ahead only when it says "nothing".

The open uploads of the copy's keys are listed beside the verdict and aborted only once the
copy holds its record's first part (the copy's own, or this very checkpoint's found there): an
upload of one of those keys is then a killed writer's, or a racing copy's of this checkpoint
(which judges the name again when its upload is gone). A copy refused there (another
checkpoint's manifest: a copy of it is running, or was killed) has aborted nothing of it.
Aborting costs a second listing, only when there was an upload to abort. Writing ahead before
the verdict is sound: every write is only where nothing has the name, and a verdict other than
"nothing" (or an error) takes back what was written, which no other writer can have used in
that moment but a copy of this very checkpoint, whose commit writes it again when it is gone
(``native_commit.commit_copy``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

from ckptctl.errors import CkptError, StorageError
from ckptctl.layouts.base import Layout, copy_ahead
from ckptctl.layouts.copying import AtDestination, CopySource
from ckptctl.ops.transfer.files import Ends, names_there
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")


@dataclass(frozen=True)
class FirstLook:
    """What the destination holds: the layout's verdict, and when it is "nothing" and the look
    went ahead, the keys already taken there (the uploads of the copy's keys were aborted
    then too); None otherwise: the copy asks for them itself. ``ahead``: the keys of the commit
    record the look wrote (``Layout.copy_ahead``), this copy's own to take back."""

    there: AtDestination
    names: frozenset[str] | None = None
    ahead: tuple[str, ...] = ()


def first_look(layout: Layout, source: CopySource, ends: Ends, *, ahead: bool) -> FirstLook:
    """The verdict on ``ends.dst`` for ``source`` and, when it is "nothing", the record's part
    written ahead; with ``ahead``, all of it and the copy's own two questions at once. Raises
    what ``copy_committed`` raises (RefusedForSafety: another checkpoint is there), then what
    ``copy_ahead`` raises (RefusedForSafety: a name of the record holds other bytes), then
    StorageError of the listing, which a copy would have met anyway."""
    if not source.files:
        return FirstLook(layout.copy_committed(source, ends.dst))
    if not ahead:
        there = layout.copy_committed(source, ends.dst)
        return FirstLook(there, None, copy_ahead(layout, source, ends.dst) if there == "nothing" else ())
    keys = [ends.at(f)[1] for f in source.files]
    place = ends.at(source.files[0])[0]
    with ThreadPoolExecutor(3, thread_name_prefix="ckptctl-look") as pool:
        pending = pool.submit(before_copy, place, keys, dry_run=True)  # best effort: it reports no error
        listed = pool.submit(names_there, ends, source.files)
        wrote = pool.submit(copy_ahead, layout, source, ends.dst)
        try:
            there = layout.copy_committed(source, ends.dst)
        except BaseException:
            _take_back(ends.dst, wrote)
            raise
    if there != "nothing":  # a damaged copy is taken back first: the copy lists again after that
        _take_back(ends.dst, wrote)
        return FirstLook(there)
    written = wrote.result()
    try:
        if pending.result():  # a killed or racing writer's uploads of this copy's keys: aborted now
            before_copy(place, keys)
        return FirstLook(there, frozenset(listed.result()), written)
    except BaseException:
        withdraw(ends.dst, written)
        raise


def _take_back(dst: Storage, wrote: Future[tuple[str, ...]]) -> None:
    """The verdict sends the copy another way (or failed): what was written ahead goes. Its
    own failure (another checkpoint's manifest there) says less than the verdict, which wins."""
    try:
        keys = wrote.result()
    except CkptError:
        return
    withdraw(dst, keys)


def withdraw(dst: Storage, keys: Iterable[str]) -> None:
    """Delete what a copy wrote ahead (by exact key), best effort: a copy that could not
    delete it is failing already, and without the rest of its record it commits nothing
    (logged; prune's partial rule removes it with the step)."""
    for key in keys:
        try:
            dst.delete(key)
        except StorageError as e:
            log.warning("could not delete %s, written ahead by a copy that did not commit: %s", dst.url_of(key), e)
