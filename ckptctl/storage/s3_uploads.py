"""Unfinished multipart uploads: which ones a writer may abort, and aborting them.

S3 keeps (and bills) the parts of an upload that was neither completed nor aborted. ``S3Writer``
aborts its own upload on every failure it sees, but a writer killed with SIGKILL, or a lost
node, sees nothing. Two rules clean up after it, and neither can abort a live writer's upload
of another object:

* **One writer per object.** A writer about to start a multipart upload of key K first aborts
  the unfinished uploads of exactly K (``supersede``), as ``abort_stale_uploads(keys=...)``
  does for the keys a copy is about to write (their writers then skip that listing). Such an upload is a dead writer's (a killed save
  or copy of the same step, now run again) or a live one racing this writer for the same
  object, a race one of them loses anyway: S3 keeps one object per key, and a conditional
  complete lets only the first one win. Aborting it ends that race at the other's next request
  instead of after both uploaded everything. An abort only discards parts: no completed object
  is ever touched.
* **Idle for longer than a bound.** ``abort_idle`` aborts uploads below a prefix that nothing
  touched for ``idle_for_s`` seconds: not started, no part received. Idleness is measured on
  the store's clock (the Date of its answers), so a client with a wrong clock cannot make a
  live upload look old. A live writer sends a part every few seconds; with hours as the bound
  (``prune --partial-after``, 6 h by default) a concurrently running writer's upload is never
  aborted.

Which uploads are ckptctl's is decided by where they are, not by a tag: S3 shows neither the
metadata nor the tags given to CreateMultipartUpload until the upload completes
(ListMultipartUploads and ListParts report key, upload id, initiator, owner, storage class,
initiation time and parts only). So a caller names the keys it is about to write, or a
predicate on the key (``where``: prune accepts keys inside checkpoint entries only). The
metadata ckptctl does give (``writer_metadata``: host, pid, start time) lands on the completed
object, where ``head-object`` shows which process wrote it.

moto (5.2.5) reports every upload's ``Initiated`` as 2010-11-10, while its parts' times are
real: there, an upload without a part yet looks idle since 2010.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Collection

from botocore.exceptions import ClientError

from ckptctl.storage.s3_bucket import Bucket, listing_prefix
from ckptctl.storage.s3_errors import error_code, is_access_denied


@dataclass(frozen=True)
class Upload:
    key: str  # the object's full key in the bucket
    upload_id: str
    initiated: float  # seconds since the epoch, as the store reports it


def writer_metadata() -> dict[str, str]:
    """Who started an upload, stored on the object it completes into (HTTP headers: ASCII)."""
    host = socket.gethostname().encode("ascii", "replace").decode("ascii")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"ckptctl-host": host, "ckptctl-pid": str(os.getpid()), "ckptctl-started": started}


def supersede(bucket: Bucket, obj_key: str, shown: str) -> int:
    """Abort every unfinished upload of exactly ``obj_key``; returns how many were aborted.

    A policy that may not list uploads (no ``s3:ListBucketMultipartUploads``) skips this: the
    write is what matters here, and ``prune`` (or a lifecycle rule) cleans up later. So does a
    key whose uploads ``abort_idle`` aborted for this writer a moment ago (a copy names the keys
    it is about to write): listing them again cost every copied file a request before its
    first part (an upload started since is a racing writer's; the conditional complete still
    lets only one of them publish), or found none of in a dry run (``first_look``)."""
    if bucket.take_cleared(obj_key):
        return 0
    # A directory bucket lists only below a "/"-ended prefix: the key's directory, then the
    # key's own uploads are picked out here, as below any other prefix.
    listed = _list(bucket, listing_prefix(obj_key) if bucket.directory else obj_key, shown, denied_ok=True)
    if listed is None:
        return 0
    return sum(_abort(bucket, u, shown) for u in listed[0] if u.key == obj_key)


def abort_idle(
    bucket: Bucket,
    list_prefix: str,
    storage_prefix: str,
    shown: str,
    *,
    idle_for_s: float,
    keys: Collection[str],
    where: Callable[[str], bool] | None,
    dry_run: bool,
) -> list[str]:
    """The uploads below ``list_prefix`` (a full key prefix, "/"-terminated or empty, as a
    directory bucket requires) to abort, by their keys relative to the storage whose own full
    key prefix is ``storage_prefix`` ("/"-terminated, or empty): those of ``keys``, and those
    ``where`` accepts that were idle for ``idle_for_s``. Aborts them unless ``dry_run``. Sorted.
    Each of ``keys`` (a writer is about to write them) left with no upload is marked cleared,
    so that its writer does not list its uploads again (``supersede``), dry run or not."""
    listed = _list(bucket, list_prefix, shown)
    assert listed is not None  # without denied_ok, an access denied raises
    uploads, now = listed
    chosen: list[tuple[str, Upload]] = []
    for upload in uploads:
        key = upload.key[len(storage_prefix):]
        if key in keys:
            chosen.append((key, upload))
        elif where is not None and not where(key):
            continue
        elif now - upload.initiated >= idle_for_s and _idle(bucket, upload, now, shown) >= idle_for_s:
            # Only an upload started before the bound can be idle that long: the parts are
            # asked for (a request per 1,000) only then.
            chosen.append((key, upload))
    if dry_run:  # the keys with no upload need no second listing by their writers either
        bucket.mark_cleared([storage_prefix + key for key in set(keys) - {key for key, _ in chosen}])
    else:
        chosen = [(key, u) for key, u in chosen if _abort(bucket, u, shown)]
        bucket.mark_cleared([storage_prefix + key for key in keys])
    return sorted(key for key, _ in chosen)


def upload_keys(bucket: Bucket, prefix: str, shown: str) -> list[str] | None:
    """The keys of the unfinished uploads below ``prefix`` (a full key prefix), or None where
    the policy may not list them."""
    listed = _list(bucket, prefix, shown, denied_ok=True)
    return None if listed is None else [u.key for u in listed[0]]


def _list(bucket: Bucket, prefix: str, shown: str, *, denied_ok: bool = False) -> tuple[list[Upload], float] | None:
    """Unfinished uploads whose key starts with ``prefix``, and the store's time of answering.
    ``denied_ok``: None for an access denied, instead of raising StorageError."""
    uploads: list[Upload] = []
    now = time.time()
    with bucket.errors(shown):
        try:
            pages = bucket.client.s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=bucket.name, Prefix=prefix
            )
            for page in pages:
                now = _server_time(page, now)
                for u in page.get("Uploads", []):
                    uploads.append(Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp()))
        except ClientError as err:
            if denied_ok and is_access_denied(err):
                return None
            raise
    return uploads, now


def _idle(bucket: Bucket, upload: Upload, now: float, shown: str) -> float:
    """Seconds since the upload last changed: started, or a part landed (parts upload in
    parallel, so the newest may be on any page)."""
    latest = upload.initiated
    with bucket.errors(shown):
        try:
            pages = bucket.client.s3.get_paginator("list_parts").paginate(
                Bucket=bucket.name, Key=upload.key, UploadId=upload.upload_id
            )
            for page in pages:
                for part in page.get("Parts", []):
                    latest = max(latest, part["LastModified"].timestamp())
        except ClientError as err:
            if error_code(err) != "NoSuchUpload":
                raise
            return -1.0  # completed or aborted meanwhile: nothing left to abort
    return now - latest


def _abort(bucket: Bucket, upload: Upload, shown: str) -> bool:
    """False when the upload was gone already (completed or aborted by someone else)."""
    with bucket.errors(shown):
        try:
            bucket.client.s3.abort_multipart_upload(
                Bucket=bucket.name, Key=upload.key, UploadId=upload.upload_id
            )
        except ClientError as err:
            if error_code(err) != "NoSuchUpload":
                raise
            return False
    return True


def _server_time(page: dict[str, Any], fallback: float) -> float:
    date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return fallback
    try:
        return parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return fallback
