"""Unfinished uploads a killed writer left on object storage: which ones a verb aborts, when.

A SIGKILLed save, ``cp``, ``restore`` or ``sync`` leaves its multipart uploads open on S3, and
S3 bills their parts until someone aborts them. The storage layer has the mechanism
(``Storage.abort_stale_uploads``; the rules and why they never abort a live writer's upload of
another object are in ``storage/s3_uploads``); this module says where each verb applies it:

* every writer of a key first aborts the open uploads of that key (the storage layer does it),
  which is how a save run again cleans up after the killed save of the same step;
* ``cp`` and ``restore``, before copying into a checkpoint directory: the uploads of the files
  it is about to write, and any other upload there idle for ``UPLOAD_IDLE_S``;
* ``sync`` (under DST's lock) and ``prune`` (``--partial-after``): uploads inside the root's
  checkpoint entries idle for that long. Only inside an entry some layout names a checkpoint
  (or a restore's staging directory), as prune treats the partial files there: an upload
  anywhere else under the root may be another tool's, and is left alone.

Local storage has no such uploads: these calls return [] there.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ckptctl.durations import format_duration
from ckptctl.errors import StorageError
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import LAYOUTS
from ckptctl.ops.transfer.staging import STAGING_PREFIX
from ckptctl.storage.base import ObjectInfo, Storage

# Idle this long, an upload is a dead writer's: a live one sends a part every few seconds.
# The same bound as prune's --partial-after default for partial checkpoint directories.
UPLOAD_IDLE_S = 6 * 3600.0



def before_copy(dst: Storage, names: Iterable[str], *, dry_run: bool = False) -> list[str]:
    """Before a copy writes ``names`` into the checkpoint directory ``dst``: abort the open
    uploads of those keys, and any other there idle for ``UPLOAD_IDLE_S``. Returns their keys
    (``dry_run``: those it would abort, aborting none).

    Best effort: a storage error here is left for the copy's own requests to report (each
    writer of a key also aborts that key's uploads as it starts), so a store that refuses
    to list uploads (IAM without ``s3:ListBucketMultipartUploads``) still gets its copy."""
    try:
        return dst.abort_stale_uploads(idle_for_s=UPLOAD_IDLE_S, keys=list(names), dry_run=dry_run)
    except StorageError:
        return []


def in_root(root: Storage, *, idle_for_s: float, notes: list[str], dry_run: bool = False,
            layouts: Sequence[Layout] = LAYOUTS) -> list[str]:
    """Abort the uploads inside ``root``'s checkpoint entries idle for ``idle_for_s``; returns
    their URLs (``dry_run``: those it would abort) and says so in ``notes``.

    A storage error is a note, not a failure: the cleanup comes beside the verb's own work
    (a prune's deletions, a sync's copies), which must not be lost to it; the next run tries
    again. The most common cause is an IAM policy without ``s3:ListBucketMultipartUploads``."""
    try:
        keys = root.abort_stale_uploads(idle_for_s=idle_for_s, where=in_checkpoint_entry(root, layouts),
                                        dry_run=dry_run)
    except StorageError as e:
        notes.append(f"unfinished multipart uploads were not cleaned up: {e} ({e.hint})")
        return []
    urls = [root.url_of(key) for key in keys]
    if urls:
        notes.append(describe(urls, dry_run=dry_run, idle_for=format_duration(idle_for_s)))
    return urls


def in_checkpoint_entry(root: Storage, layouts: Sequence[Layout] = LAYOUTS) -> Callable[[str], bool]:
    """Whether a key below ``root`` lies in an entry some layout names as a checkpoint of its
    own (a step directory, or a checkpoint file such as Lightning's), by name alone: a killed
    save's directory may hold nothing but its upload, so there are no files to judge by."""
    bound = [layout.for_root(root) for layout in layouts]

    def accept(key: str) -> bool:
        first, sep, _ = key.partition("/")
        if sep and first.startswith(STAGING_PREFIX):
            return True
        child = ObjectInfo(first, 0, 0.0, "dir" if sep else "file")
        return any(layout.step_of(child) is not None for layout in bound)

    return accept


def describe(urls: Sequence[str], *, dry_run: bool, idle_for: str) -> str:
    """One line for a plan or a result's notes."""
    verb = "would abort" if dry_run else "aborted"
    shown = ", ".join(urls[:3]) + (f" (+{len(urls) - 3} more)" if len(urls) > 3 else "")
    return f"{verb} {len(urls)} unfinished multipart upload(s) idle for more than {idle_for}: {shown}"
