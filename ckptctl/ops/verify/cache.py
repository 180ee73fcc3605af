"""Remember full verifications, so that the next prune does not re-read an unchanged checkpoint.

Verifying at level ``load`` reads every byte; on terabytes that is the expensive part of a prune.
After a checkpoint verifies, its *fingerprint* is recorded: its layout's ``identity`` (ckptctl's
own: the manifest checksum its marker commits), and for every file in the checkpoint directory
its key, size and modification time, plus, on POSIX, the nanosecond mtime, the ctime and the
inode, and on S3 the ETag (LastModified has whole seconds only: a same-size rewrite within the
second would look unchanged without it). A checkpoint whose layout names no identity is never
recorded: each run checks it afresh (or by its seal), and its fingerprint still tells whether it
changed while it was read. A later run trusts the recorded "ok" only when a fresh fingerprint is
equal in every field. Changing a file's bytes through the
filesystem changes its ctime even when its size and mtime are put back (``os.utime`` cannot set
ctime), so on POSIX such an edit is caught without ``--reverify``; what a fingerprint cannot see
is corruption below the filesystem (bit rot, a bad disk or controller), which is why
``--reverify`` exists and why a periodic full re-check is still worth running.

Where the record lives: one file, ``ROOT/.ckptctl-verified.json``, not a file per checkpoint.
A committed checkpoint directory is never written again after its marker (copies, ``restore``
and ``ls`` sizes see exactly what was saved, and a read-only snapshot of a checkpoint stays
valid); one object is also one PUT per prune on S3. Entries are keyed by step directory name and
dropped when their checkpoint is deleted. The record is an optimisation, never a source of
truth: an unreadable or damaged file is ignored (everything is re-verified) and a failed write
only costs a re-read next time. Only successes are recorded, so a failure is always re-checked.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import InvalidCheckpoint, NotFound, StorageError
from ckptctl.format import parse
from ckptctl.layouts.base import Layout
from ckptctl.layouts.checked import LEVELS, Checked, Level
from ckptctl.ops.verify.engine import verify
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

CACHE_KEY = ".ckptctl-verified.json"
_FORMAT = "ckptctl-verified"
_VERSION = 1
_MAX_BYTES = 64 << 20

# key, size, mtime (s), mtime_ns, ctime_ns, inode (None on object stores), etag (None on
# filesystems). Recorded without the etag when it has none, as before it was stamped.
Stamp = tuple[str, int, float, int | None, int | None, int | None, str | None]


@dataclass(frozen=True)
class Fingerprint:
    manifest_checksum: str | None  # the layout's identity (the record's key keeps its first name)
    stamps: tuple[Stamp, ...]

    def to_doc(self) -> dict[str, Any]:
        return {"manifest_checksum": self.manifest_checksum,
                "stamps": [list(s) if s[6] is not None else list(s[:6]) for s in self.stamps]}

    @classmethod
    def from_doc(cls, doc: Any) -> "Fingerprint | None":
        """The recorded fingerprint, or None when the record is not one (any wrong type or range)."""
        try:
            entry = parse.Obj(doc, CACHE_KEY, "verification record entry")
            stamps = tuple(_stamp(s) for s in entry.list("stamps"))
            return cls(entry.str("manifest_checksum", max_len=128), stamps)
        except InvalidCheckpoint:
            return None


def _stamp(doc: Any) -> Stamp:
    if not isinstance(doc, list) or len(doc) not in (6, 7):
        raise parse.invalid(CACHE_KEY, "a stamp is not a list of 6 or 7 items")
    key, size, mtime, mns, cns, ino, etag = doc if len(doc) == 7 else [*doc, None]
    err = lambda why: parse.invalid(CACHE_KEY, f"a stamp value {why}")  # noqa: E731
    if not isinstance(key, str) or not (etag is None or isinstance(etag, str) and len(etag) <= 128):
        raise err("is not a string")
    opt = [None if v is None else parse.as_int(v, lo=-parse.INT64_MAX, hi=parse.INT64_MAX, err=err) for v in (mns, cns, ino)]
    return (key, parse.as_int(size, lo=0, hi=parse.INT64_MAX, err=err),
            parse.as_float(mtime, lo=-parse.MAX_TIME, hi=parse.MAX_TIME, err=err), opt[0], opt[1], opt[2], etag)


def _entry(doc: Any) -> dict[str, Any] | None:
    """A recorded success with every field the lookup uses checked, or None to drop it."""
    try:
        e = parse.Obj(doc, CACHE_KEY, "verification record entry")
        if e.str("level", max_len=16) not in LEVELS:
            return None
        e.float("verified_at", lo=0.0, hi=parse.MAX_TIME)
        e.int("step", lo=0, hi=parse.INT64_MAX, default=None)
        e.int("files", default=0)
        e.int("tensors", default=0)
    except InvalidCheckpoint:
        return None
    return doc if Fingerprint.from_doc(doc) is not None else None


def fingerprint(ckpt: Storage, layout: Layout) -> Fingerprint:
    """The fingerprint of a checkpoint of ``layout`` as it is now."""
    stamps = []
    for info in ckpt.list():
        mtime_ns = ctime_ns = inode = None
        path = ckpt.local_path(info.key)
        if path is not None:
            try:
                st = os.lstat(path)
                mtime_ns, ctime_ns, inode = st.st_mtime_ns, st.st_ctime_ns, st.st_ino
            except FileNotFoundError:
                pass  # deleted since listed: the stamp differs from any recorded one anyway
        stamps.append((info.key, info.size, info.mtime, mtime_ns, ctime_ns, inode, info.etag))
    return Fingerprint(layout.identity(ckpt), tuple(sorted(stamps)))


class VerifyCache:
    """The verification record of one root. ``load``, look up and record, then ``save``."""

    def __init__(self, root: Storage, entries: dict[str, dict[str, Any]] | None = None, note: str | None = None,
                 *, read_only: bool = False) -> None:
        self.root = root
        self.entries = entries or {}
        self.notes: list[str] = [note] if note else []
        self.read_only = read_only  # a dry run: looked up, updated in memory, never written
        self._dirty = False

    @classmethod
    def load(cls, root: Storage, *, read_only: bool = False) -> "VerifyCache":
        """The record of ``root`` (empty when missing or unreadable). ``read_only``: ``save``
        writes nothing (``prune --dry-run`` and ``du`` write nothing anywhere)."""
        cache = cls._load(root)
        cache.read_only = read_only
        return cache

    @classmethod
    def _load(cls, root: Storage) -> "VerifyCache":
        try:
            raw = root.read(CACHE_KEY, max_size=_MAX_BYTES)
        except NotFound:
            return cls(root)
        except (StorageError, InvalidCheckpoint) as e:
            return cls(root, note=f"ignored the verification record {root.url_of(CACHE_KEY)}: {e}")
        where = root.url_of(CACHE_KEY)
        try:
            doc = parse.load_json(raw, where, "verification record", max_bytes=_MAX_BYTES, max_depth=8)
            top = parse.Obj(doc, where, "verification record")
            if doc.get("format") != _FORMAT:
                raise parse.invalid(where, "not a ckptctl verification record")
            parse.check_version(doc, where, "verification record", supported=_VERSION)
            entries = top.dict("entries")
        except InvalidCheckpoint as e:
            return cls(root, note=f"ignored the unreadable verification record: {e}")
        kept = {k: v for k, v in ((k, _entry(v)) for k, v in entries.items()) if v is not None}
        return cls(root, kept)

    def lookup(self, name: str, fp: Fingerprint, level: Level) -> dict[str, Any] | None:
        """The recorded success for ``name`` if it covers ``level`` and ``fp`` is unchanged."""
        if fp.manifest_checksum is None:
            return None  # nothing names its contents: never recorded
        entry = self.entries.get(name)
        if entry is None or entry.get("level") not in LEVELS:
            return None
        if LEVELS.index(entry["level"]) < LEVELS.index(level):
            return None
        return entry if Fingerprint.from_doc(entry) == fp else None

    def record(self, name: str, fp: Fingerprint, found: Checked) -> None:
        """Remember that the check ``found`` passed on the checkpoint ``name`` as ``fp`` shows it."""
        if not found.ok or fp.manifest_checksum is None:  # failures are never remembered: re-checked every time
            self.forget(name)
            return
        self.entries[name] = {
            "level": found.level,
            "verified_at": time.time(),
            "step": found.step,
            "files": found.files,
            "tensors": found.tensors,
            **fp.to_doc(),
        }
        self._dirty = True

    def forget(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._dirty = True

    def retain(self, names: set[str]) -> None:
        """Drop entries of checkpoints that no longer exist."""
        for name in [n for n in self.entries if n not in names]:
            self.forget(name)

    def save(self) -> None:
        """Write the record if it changed (never when ``read_only``). A failure is noted, never
        raised: the record only saves time."""
        if not self._dirty or self.read_only:
            return
        doc = {"format": _FORMAT, "version": _VERSION, "entries": self.entries}
        try:
            self.root.write_atomic(CACHE_KEY, json.dumps(doc, separators=(",", ":")).encode())
            self._dirty = False
        except StorageError as e:
            self.notes.append(f"could not save the verification record (next run re-verifies): {e}")


def verify_cached(
    ckpt: Storage,
    name: str,
    cache: VerifyCache | None,
    *,
    layout: Layout,
    level: Level = "load",
    reverify: bool = False,
    progress: Progress | None = None,
) -> tuple[VerifyReport, bool, Fingerprint | None]:
    """Verify ``ckpt`` (directory ``name`` under the cache's root, a checkpoint of ``layout``)
    at ``level``: the same check ``verify`` makes (``ops.verify.engine``), or a success the
    record holds for this very fingerprint.

    Returns the report, whether it came from the record (no data read), and the fingerprint the
    report vouches for: taken before reading and again after, and None unless both agree, so
    neither the record nor a caller ever trusts a result for bytes that changed while read.
    """
    before = fingerprint(ckpt, layout)
    if cache is not None and not reverify:
        hit = cache.lookup(name, before, level)
        if hit is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(hit.get("verified_at", 0))))
            recorded = Checked(level, step=hit.get("step"), files=int(hit.get("files", 0)),
                               tensors=int(hit.get("tensors", 0)),
                               notes=[f"verified at {when}; unchanged since (--reverify re-reads it)"])
            return VerifyReport(ckpt.url, recorded), True, before
    report = verify(ckpt, layout, level, progress)
    vouched = before if fingerprint(ckpt, layout) == before else None
    if cache is not None:
        if report.ok and vouched is not None:
            cache.record(name, vouched, report.found)
        else:
            cache.forget(name)
    return report, False, vouched
