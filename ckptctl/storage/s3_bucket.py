"""One bucket, reached through one client: the requests every S3 module makes the same way.

``S3Storage`` (addressing, listing, one-PUT writes), ``s3_transfer`` (multipart writes),
``s3_reader`` (ranged reads) and ``s3_uploads`` (unfinished uploads) all talk to a bucket:
with the shared client, errors translated into ckptctl's tree, the request checksum the user's
configuration asks for, and conditional writes that tell "created" from "already there". That
is this module; each of the four imports it, and none of them imports another's storage
class, so they form no cycle.

It also knows which kind of bucket it is. An S3 Express One Zone *directory bucket* (its name
ends in ``--x-s3``) takes only listings whose prefix ends in ``/`` (the only delimiter it
accepts) and lists objects and uploads in no particular order; the modules that list ask
``directory`` and send only what it accepts (docs/decisions.md, "S3 Express directory buckets").
botocore itself signs for such a bucket with the session its CreateSession returns.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from botocore.exceptions import BotoCoreError, ClientError

from ckptctl.storage.s3_client import Client, ClientHolder
from ckptctl.storage.s3_errors import error_code, http_status, is_precondition_failed, s3_error

_CONFLICT_RETRIES = 5  # S3 answers 409 while another conditional PUT to the key is in flight
DIRECTORY_BUCKET_SUFFIX = "--x-s3"  # AWS's naming rule for directory buckets, and only theirs


def listing_prefix(key: str) -> str:
    """The longest ``/``-ended prefix of ``key`` ("" for a key without one): the narrowest
    listing a directory bucket accepts that still holds ``key``."""
    return key[: key.rfind("/") + 1]


class Bucket:
    """The bucket ``name`` through a client built lazily (constructing touches no network and
    needs no credentials) and shared by a storage and every ``sub()`` of it."""

    def __init__(self, name: str, endpoint_url: str | None) -> None:
        self.name = name
        # S3 Express One Zone: listings only below "/"-ended prefixes, in no order.
        self.directory = name.endswith(DIRECTORY_BUCKET_SUFFIX)
        self._holder = ClientHolder(endpoint_url)
        # Full keys whose unfinished uploads this process has just aborted, for the writer about
        # to write each (``s3_uploads``): that writer need not list them again.
        self._cleared: set[str] = set()
        self._cleared_lock = threading.Lock()

    @property
    def client(self) -> Client:
        return self._holder.get()

    @contextmanager
    def errors(self, shown: str) -> Iterator[None]:
        """Botocore's errors about ``shown`` (an s3:// URL) raised as ckptctl's."""
        try:
            yield
        except (ClientError, BotoCoreError) as err:
            raise s3_error(err, shown, self.name, self._holder.endpoint()) from err

    def mark_cleared(self, keys: list[str]) -> None:
        with self._cleared_lock:
            self._cleared.update(keys)

    def take_cleared(self, key: str) -> bool:
        """Whether ``key``'s uploads were cleared for the writer asking, once: the next writer
        of the key finds it unmarked and lists them again."""
        with self._cleared_lock:
            if key not in self._cleared:
                return False
            self._cleared.discard(key)
            return True

    def checksum_args(self) -> dict[str, str]:
        """The checksum a PUT or part carries, so S3 refuses bytes corrupted on the way."""
        algorithm = self.client.checksum
        return {"ChecksumAlgorithm": algorithm} if algorithm else {}

    def if_absent(self, shown: str, request: Callable[[], object]) -> bool:
        """Run ``request``, a PUT or a CompleteMultipartUpload carrying ``If-None-Match: *``:
        True when it created the object, False when the key already existed (412)."""
        for attempt in range(_CONFLICT_RETRIES):
            with self.errors(shown):
                try:
                    request()
                    return True
                except ClientError as err:
                    if is_precondition_failed(err):
                        return False
                    conflict = error_code(err) == "ConditionalRequestConflict" or http_status(err) == 409
                    if not conflict or attempt == _CONFLICT_RETRIES - 1:
                        raise
            # Another conditional write to the key is in flight; once it lands ours gets a 412.
            time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")
