"""The promotion round of a node-local first tier: every rank uploads its own shards, in
parallel; rank 0 commits the next tier's manifest and marker only after every rank reported
its upload durable.

Rank 0's promoter (``tiers.promoter``: cadence, skip-when-behind, backoff) decides which step
and when, and runs one round per attempt through ``RoundLeader.copy`` (its copy function):

1. rank 0 reads its node's commit of the step (marker, then manifest) and returns at once when
   the next tier already commits the same manifest bytes and every file it lists is there at
   its size ("already present"; one listing, no bytes read back); the same checkpoint with a
   file missing or of another size is uncommitted, marker first, and promoted again; another
   manifest there is refused, never replaced;
2. it sends ``{"op": "promote", name, manifest}`` on the channel's ``promote`` stream;
3. every rank's ``RoundWorker`` thread (rank 0's too) uploads the files the manifest lists
   for its rank, from its node's first tier, checked on the way (``tiers.upload``), and
   replies ``ok:<bytes>``, ``retry:<why>`` (an operational error: the next tier unreachable)
   or ``bad:<why>`` (its shard is damaged or gone);
4. rank 0 waits for every reply, up to the round's deadline, which grows with the bytes the
   busiest rank must upload (``round_deadline``: a floor, a minimum rate, a ceiling); a rank
   whose process stopped beating is answered for sooner (``tiers.liveness``). Any ``bad``
   gives the step up (InvalidCheckpoint); a ``retry``, a missing reply (a rank hung, or slower
   than the minimum rate) or a dead rank is an operational error, so the promoter backs off
   and retries: the same step when this round got more of it to the next tier than before
   (what is there is not uploaded again), else the newest chosen step;
5. meanwhile rank 0 writes the manifest at the next tier (``layouts.native_commit.manifest_ahead``:
   without the marker it commits nothing; another checkpoint's manifest there refuses the round
   once it concluded), and takes it back when the round fails; only when every rank replied
   ``ok``: rank 0 checks every listed file is at the next tier at its size, then writes the
   marker last (``layouts.native_commit.commit_copy``), the one request after the data;
6. then it sweeps: the older steps its rounds left without a marker (a rank failed or was
   killed, the step was given up or skipped for a newer one) are removed from the next tier
   by ``ckptctl prune``'s partial rules (``tiers.leftovers``), their open multipart uploads
   aborted first; at once when every rank answered their last round (no writer of ours is
   left there), else once idle for prune's partial-after time, like any partial step a killed
   earlier run left (looked for hourly).

A rank that dies mid-round leaves files without a marker: the next tier's newest committed
checkpoint is still the one before, and a later round of the same step (this run's or the
next run's) resumes it: each rank's writer first aborts the open uploads of its keys
(``ops.transfer.uploads.before_copy``), keeps a file already there holding exactly its bytes
(proven by reading it back) and publishes the others only where nothing has their name; the
manifest and the marker are written only if absent (``manifest_ahead``, ``commit_copy``). A name
holding other bytes (another job promoting the same step) is never replaced: that round is
refused for safety, and the step given up. The workers are threads of their own on every rank: training and the saver's writer never wait
for a round.

May import: ``tiers.channel``, ``tiers.stream``, ``tiers.liveness``, ``tiers.promoter``,
``tiers.upload``, ``tiers.leftovers``, ``ops.transfer.copy`` (its
result type), ``ops.transfer.uploads``, ``ops.transfer.first_look`` (``withdraw``), ``layouts.native``,
``format``, ``storage``, leaves.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import (
    CheckpointError,
    CkptError,
    CoordinationError,
    InvalidCheckpoint,
    OperationalError,
    RefusedForSafety,
    StorageError,
)
from ckptctl.format.layout import MARKER
from ckptctl.format.manifest import Manifest
from ckptctl.layouts.native_commit import check_target_name, commit_copy, manifest_ahead, uncommit
from ckptctl.layouts.native_read import Committed, read_committed_raw
from ckptctl.ops.transfer.copy import CopyResult
from ckptctl.ops.transfer.first_look import withdraw
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.ops.transfer.uploads import in_root as uploads_in_root
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.leftovers import PARTIAL_AFTER_S, sweep
from ckptctl.tiers.liveness import Watch
from ckptctl.tiers.promoter import Progressed
from ckptctl.tiers.stream import StreamWorker
from ckptctl.tiers.upload import upload_files

log = logging.getLogger("ckptctl")

STREAM = "promote"


def _name_of(ckpt: Storage) -> str:
    return ckpt.url.rstrip("/").rsplit("/", 1)[-1]


# How often a leader also looks for partial steps it did not leave itself (a killed earlier
# run's rounds), which are removed only once idle for prune's partial-after time.
FULL_SWEEP_S = 3600.0

# A round's deadline: ROUND_FLOOR_S (set-up, listings, small shards on a loaded host) plus the
# busiest rank's bytes at ROUND_MIN_RATE (a rank uploading slower is taken as stuck), at most
# ROUND_CEILING_S. A dead rank is answered for after the save's liveness_s (``tiers.liveness``).
ROUND_FLOOR_S = 120.0
ROUND_MIN_RATE = 8 << 20  # bytes per second and rank
ROUND_CEILING_S = 6 * 3600.0


def round_deadline(busiest_bytes: int) -> float:
    """Seconds rank 0 waits for a round in which the busiest rank uploads ``busiest_bytes``.

    >>> round_deadline(0), round_deadline(8 << 30), round_deadline(1 << 50)
    (120.0, 1144.0, 21600.0)
    """
    return min(ROUND_FLOOR_S + busiest_bytes / ROUND_MIN_RATE, ROUND_CEILING_S)


@dataclass(frozen=True)
class _Attempt:
    step: int
    files: tuple[str, ...]  # the keys its rounds wrote into the step's directory
    quiet: bool  # every rank answered its last round: none of ours still writes there


class RoundLeader:
    """Rank 0's side: ``copy`` is the promoter's copy function for the first hop into the
    root ``remote`` (the next tier's). ``liveness_s``: the save's (a rank silent that long is
    dead)."""

    def __init__(self, channel: Channel, remote: Storage, liveness_s: float) -> None:
        self.channel, self.remote = channel, remote
        # Each round is concluded before the next is sent: a rank still busy with an older one skips to the newest.
        self.outbox = channel.outbox(STREAM, range(channel.world_size), 1, collected=True, latest_only=True)
        self._link = channel.link("promotion leader", remote.url)  # the promoter thread's
        # The whole store: the heartbeats and the replies live under two prefixes.
        self._watch = Watch(channel.link("promotion watch", remote.url, prefixed=False), channel.group_name,
                            channel.prefix, liveness_s)
        self._attempted: dict[str, _Attempt] = {}  # rounds sent, marker not written: name -> what
        self._done: dict[str, set[int]] = {}  # name -> ranks whose files reached the next tier
        self._next_full_sweep = 0.0  # time.monotonic() of the next look at every partial step

    def copy(self, src: Storage, dst: Storage) -> CopyResult:
        t0 = time.perf_counter()
        source = read_committed_raw(src)
        step, files = source.manifest.step, source.manifest.files
        check_target_name(dst, step)
        if _already_present(dst, source):
            return CopyResult(src.url, dst.url, step, "already present", files=len(files),
                              seconds=time.perf_counter() - t0)
        name = _name_of(src)
        per_rank: dict[int, int] = {}
        for f in files:
            per_rank[f.rank] = per_rank.get(f.rank, 0) + f.size
        deadline = round_deadline(max(per_rank.values(), default=0))
        n = self.outbox.send({"op": "promote", "name": name,
                              "manifest": base64.b64encode(source.manifest_raw).decode()})
        # The manifest goes while the ranks upload (without the marker it commits nothing), so
        # only the marker follows their data; its failure is raised once the round concluded.
        refused: CkptError | None = None
        try:
            wrote = (source.marker.manifest_name,) if manifest_ahead(dst, source) else ()
        except CkptError as e:  # raised once the round concluded: the ranks are uploading now
            wrote, refused = (), e
        keys = {k: f"{STREAM}/{n}/r{k}" for k in range(self.channel.world_size)}
        try:
            with self._watch.during(keys):
                replies = self.outbox.replies(self._link, n, deadline)
            self._conclude(name, step, dst, source, replies, deadline, refused)
        except BaseException:
            withdraw(dst, wrote)  # a round that does not commit takes back the manifest it wrote
            raise
        commit_copy(dst, source, wrote)  # the marker last
        self._attempted.pop(name, None)
        self._done.pop(name, None)
        try:
            self._sweep(name, step)
        except CkptError as e:  # the step is promoted; the leftovers wait for the next sweep
            log.info("promotion to %s: leftovers of older rounds not swept this time: %s", self.remote.url, e)
        copied = sum(int(v.split(":", 1)[1] or 0) for v in replies.values())
        return CopyResult(src.url, dst.url, step, "copied", files=len(files), bytes_copied=copied,
                          seconds=time.perf_counter() - t0)

    def _conclude(self, name: str, step: int, dst: Storage, source: Committed, replies: dict[int, str],
                  deadline: float, refused: CkptError | None) -> None:
        """Raise unless the round got every listed file to the next tier (and its manifest was
        written ahead, or found there holding its bytes): what the marker may then commit."""
        files = source.manifest.files
        # Until its marker is written, this step's objects at ``dst`` are a leftover to sweep
        # once a newer step is committed there; quiet when no rank of this round still writes.
        answered = [k for k, v in replies.items() if not v.startswith("dead:")]
        self._attempted[name] = _Attempt(step, tuple(f.name for f in files), len(answered) == self.channel.world_size)
        done = self._done.setdefault(name, set())
        gained = {k for k, v in replies.items() if v.startswith("ok:")} - done
        done |= gained
        try:
            _judge(step, dst, replies, self.channel.world_size, deadline)
            if refused is not None:  # the manifest could not be written ahead
                raise refused
        except OperationalError as e:
            if gained:  # more of it is at the next tier than before: retrying it costs only the rest
                raise Progressed(f"{e} ({len(done)} of {self.channel.world_size} ranks' files are there)",
                                 hint=e.hint) from None
            raise
        except CkptError:
            self._done.pop(name, None)
            raise
        # Each rank's ok is its own writer's commit; the sizes are checked from one listing (a
        # stat per file was a round trip each, in series, between the data and the marker).
        there = {info.key: info.size for info in dst.list() if info.kind == "file"}
        for f in files:
            size = there.get(f.name)
            if size != f.size:
                raise StorageError(f"{dst.url_of(f.name)}: {'missing' if size is None else f'{size} bytes'} "
                                   f"after rank {f.rank} reported it uploaded ({f.size} bytes)",
                                   hint="the next tier lost a write; the promotion is retried")

    def _sweep(self, anchor: str, step: int) -> None:
        """After ``anchor`` (step) was committed on the next tier: remove the objects of the older
        steps this leader's rounds left without a marker (never promoted by this run now: the
        promoter takes only newer steps), and, hourly, any partial older step idle for the
        partial-after time (a killed earlier run's round), by ``ckptctl prune``'s rules
        (``tiers.leftovers``). On the promoter's thread, so no round of ours runs meanwhile."""
        root = self.remote
        older = {k: a for k, a in self._attempted.items() if a.step < step}
        quiet = {k for k, a in older.items() if a.quiet}
        due = time.monotonic() >= self._next_full_sweep
        if not quiet and not due:
            return  # the others wait for the idle time: looked at hourly, one listing of the root each
        for k in quiet:  # first, so that no upload completes into a directory once it is removed
            before_copy(root.sub(k), older[k].files)
        if due:
            self._next_full_sweep = time.monotonic() + FULL_SWEEP_S
            notes: list[str] = []
            uploads_in_root(root, idle_for_s=PARTIAL_AFTER_S, notes=notes)
            for note in notes:
                log.info("promotion to %s: %s", root.url, note)
        sweep(root, anchor, command="ckptctl promotion", quiet=quiet, below=step)
        for k in older:
            if root.stat(k) is None or root.sub(k).stat(MARKER) is not None:
                self._attempted.pop(k, None)  # gone (or committed by someone else: never ours to remove)
                self._done.pop(k, None)

    def stop(self) -> int:
        """Tell every rank's upload thread to end (after the round it is in, if any). Returns
        the ``stop`` message's number. (The leader's own connections are not pooled: a round
        left running past ``close`` may still use them.)"""
        return self.outbox.stop()

    def close(self, timeout_s: float = 5.0) -> None:
        """``stop``, then wait up to ``timeout_s`` for every rank to take it (``Outbox.finish``)."""
        self.outbox.finish(self.stop(), timeout_s)


def _already_present(dst: Storage, source: Committed) -> bool:
    """Whether ``dst`` already commits ``source``: its marker commits the same manifest bytes
    and every file that manifest lists is there at its recorded size (one listing). The bytes
    are not read back (that would download the checkpoint): see docs/protocol.md for the trust
    this gives. The same checkpoint with a file missing or of another size is uncommitted
    (marker first, then those files), as ``copy_checkpoint`` does, so that the round uploads
    them again; another
    committed checkpoint there is refused, never replaced. Raises RefusedForSafety, StorageError."""
    if dst.stat(MARKER) is None:
        return False
    try:
        there = read_committed_raw(dst).manifest_raw
    except CheckpointError as e:
        raise RefusedForSafety(f"{dst.url} has a marker but is not a valid checkpoint ({e})",
                               hint=f"inspect it with `ckptctl verify {dst.url}`") from None
    if there != source.manifest_raw:
        raise RefusedForSafety(f"{dst.url} already holds a different committed checkpoint",
                               hint="another run promotes into this root; stop it")
    sizes = {i.key: i.size for i in dst.list() if i.kind == "file"}
    wrong = [f for f in source.manifest.files if sizes.get(f.name) != f.size]
    if not wrong:
        return True
    f = wrong[0]
    log.warning("%s commits step %d but %s is %s, not %d bytes%s; uncommitting it to promote it again", dst.url,
                source.manifest.step, f.name, "missing" if f.name not in sizes else f"{sizes[f.name]} bytes", f.size,
                f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else "")
    uncommit(dst)
    for f in wrong:  # damaged files of this very checkpoint: published again, never written over
        dst.delete(f.name)
    return False


def _judge(step: int, dst: Storage, replies: dict[int, str], world_size: int, deadline_s: float) -> None:
    """Raise unless every rank replied ok: a damaged shard gives the step up; anything else is
    retried."""
    bad = {k: v[4:] for k, v in replies.items() if v.startswith("bad:")}
    if bad:
        k = min(bad)
        raise InvalidCheckpoint(f"step {step}: rank {k} could not upload its shard to {dst.url}: {bad[k]}",
                                hint="that node's first tier is damaged; a newer checkpoint will be promoted")
    dead = {k: v[5:] for k, v in replies.items() if v.startswith("dead:")}
    if dead:
        k = min(dead)
        raise CoordinationError(f"step {step}: rank {k} did not report its upload to {dst.url}: {dead[k]}; "
                                "no marker was written", hint="the promotion is retried with backoff")
    missing = [k for k in range(world_size) if k not in replies]
    if missing:
        raise CoordinationError(f"step {step}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                                f"did not report its upload to {dst.url} within {deadline_s:.0f} s (the round's "
                                "deadline for its bytes); no marker was written",
                                hint="the promotion is retried with backoff")
    retry = {k: v[6:] for k, v in replies.items() if v.startswith("retry:")}
    if retry:
        k = min(retry)
        raise StorageError(f"step {step}: rank {k} could not upload to {dst.url}: {retry[k]}",
                           hint="the promotion is retried with backoff")


class RoundWorker(StreamWorker):
    """Every rank's side: a thread that uploads this rank's shards for each round."""

    ops = frozenset({"promote"})

    def __init__(self, channel: Channel, local: Storage, remote: Storage) -> None:
        self.local, self.remote = local, remote
        # The link is made here, not on the thread: see ``tiers.link``.
        super().__init__(channel.link(f"upload thread (rank {channel.rank})", remote.url), STREAM, channel.rank,
                         channel.health)
        self.start()

    def handle(self, n: int, msg: dict[str, Any]) -> str:
        name = str(msg["name"])
        try:
            src, dst = self.local.sub(name), self.remote.sub(name)
            manifest = Manifest.from_json(base64.b64decode(msg["manifest"]), src.url_of("manifest"))
            mine = [f for f in manifest.files if f.rank == self.rank]
            done = upload_files(src, dst, manifest, mine)
            return f"ok:{done.bytes}"
        except OperationalError as e:
            return f"retry:{e}"
        except CkptError as e:
            return f"bad:{e}"
        except Exception as e:  # a bug must not end this rank's part in promotion: rank 0 gives the step up
            log.error("upload of %s to %s failed unexpectedly", name, self.remote.url, exc_info=e)
            return f"bad:unexpected {type(e).__name__}: {e}"
