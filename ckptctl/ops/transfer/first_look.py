"""A copy's first look at its destination: the layout's verdict (``Layout.copy_committed``:
is this checkpoint, or another, committed there?) and what the copy asks before its first part
(the open uploads of the files it is about to write, aborted: ``uploads.before_copy``; the
names already taken: ``files.names_there``), all in flight at once.

On object storage each is a round trip, and a first part that waited for them one after the
other waited for three (``docs/decisions.md``, "S3: a save's and a copy's requests around the
data"). The two for the copy are only of use when the verdict is "nothing" (the common case:
a copy into a destination expected empty), so a caller that expects the checkpoint there
already (``sync``, for each checkpoint the mirror's listing shows) asks for the verdict alone.

Aborting the uploads before the verdict is sound: the keys are the ones this copy is about to
write, and an upload of one of them is a killed writer's, or a racing writer's that could not
publish anyway where the step is committed (every publish is conditional); an abort discards
parts only, never an object.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptctl.layouts.base import Layout
from ckptctl.layouts.copying import AtDestination, CopySource
from ckptctl.ops.transfer.files import Ends, names_there
from ckptctl.ops.transfer.uploads import before_copy


@dataclass(frozen=True)
class FirstLook:
    """What the destination holds: the layout's verdict, and when it is "nothing" and the look
    went ahead, the keys already taken there (the uploads of the copy's keys were aborted
    then too); None otherwise: the copy asks for them itself."""

    there: AtDestination
    names: frozenset[str] | None = None


def first_look(layout: Layout, source: CopySource, ends: Ends, *, ahead: bool) -> FirstLook:
    """The verdict on ``ends.dst`` for ``source``; with ``ahead``, the copy's own two questions
    beside it. Raises what ``copy_committed`` raises (RefusedForSafety: another checkpoint is
    there), then StorageError of the listing, which a copy would have met anyway."""
    if not ahead or not source.files:
        return FirstLook(layout.copy_committed(source, ends.dst))
    keys = [ends.at(f)[1] for f in source.files]
    place = ends.at(source.files[0])[0]
    with ThreadPoolExecutor(2, thread_name_prefix="ckptctl-look") as pool:
        pool.submit(before_copy, place, keys)  # best effort: it reports no error
        listed = pool.submit(names_there, ends, source.files)
        there = layout.copy_committed(source, ends.dst)  # an error here waits for both, then raises
    if there != "nothing":  # a damaged copy is taken back first: the copy lists again after that
        return FirstLook(there)
    return FirstLook(there, frozenset(listed.result()))
