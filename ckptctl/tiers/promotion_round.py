"""The promotion round of a node-local first tier: every rank uploads its own shards, in
parallel; rank 0 commits the next tier's manifest and marker only after every rank reported
its upload durable.

Rank 0's promoter (``tiers.promoter``: cadence, skip-when-behind, backoff) decides which step
and when, and runs one round per attempt through ``RoundLeader.copy`` (its copy function):

1. rank 0 reads its node's commit of the step (marker, then manifest) and returns at once when
   the next tier already commits the same manifest ("already present"; another manifest there
   is refused, never replaced);
2. it sends ``{"op": "promote", name, manifest}`` on the channel's ``promote`` stream;
3. every rank's ``RoundWorker`` thread (rank 0's too) uploads the files the manifest lists
   for its rank, from its node's first tier, checked on the way (``tiers.upload``), and
   replies ``ok:<bytes>``, ``retry:<why>`` (an operational error: the next tier unreachable)
   or ``bad:<why>`` (its shard is damaged or gone);
4. rank 0 waits for every reply, up to the round's timeout: any ``bad`` gives the step up
   (InvalidCheckpoint); a ``retry`` or a missing reply (a rank dead or hung) is an operational
   error, so the promoter backs off and retries, with the newest chosen step;
5. only when every rank replied ``ok``: rank 0 checks every listed file is at the next tier
   at its size, then writes the manifest and the marker last (``layouts.native.commit_copy``).

A rank that dies mid-round leaves files without a marker: the next tier's newest committed
checkpoint is still the one before, and a later round (this run's or the next run's) writes
the same names again. The workers are threads of their own on every rank: training and the
saver's writer never wait for a round.

May import: ``tiers.channel``, ``tiers.upload``, ``ops.transfer.copy`` (its result type),
``layouts.native``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from typing import Any

import torch.distributed as dist

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
from ckptctl.layouts.native import check_target_name, commit_copy, read_committed_raw
from ckptctl.ops.transfer.copy import CopyResult
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.upload import upload_files

log = logging.getLogger("ckptctl")

STREAM = "promote"


def _name_of(ckpt: Storage) -> str:
    return ckpt.url.rstrip("/").rsplit("/", 1)[-1]


class RoundLeader:
    """Rank 0's side: ``copy`` is the promoter's copy function for the first hop."""

    def __init__(self, channel: Channel, timeout_s: float) -> None:
        self.channel, self.timeout_s = channel, timeout_s
        self._conn: "dist.Store | None" = None

    def copy(self, src: Storage, dst: Storage) -> CopyResult:
        t0 = time.perf_counter()
        source = read_committed_raw(src)
        step, files = source.manifest.step, source.manifest.files
        check_target_name(dst, step)
        if dst.stat(MARKER) is not None:
            try:
                there = read_committed_raw(dst).manifest_raw
            except CheckpointError as e:
                raise RefusedForSafety(f"{dst.url} has a marker but is not a valid checkpoint ({e})",
                                       hint=f"inspect it with `ckptctl verify {dst.url}`") from None
            if there != source.manifest_raw:
                raise RefusedForSafety(f"{dst.url} already holds a different committed checkpoint",
                                       hint="another run promotes into this root; stop it")
            return CopyResult(src.url, dst.url, step, "already present", files=len(files),
                              seconds=time.perf_counter() - t0)
        if self._conn is None:
            self._conn = self.channel.connection()
        n = self.channel.send(STREAM, {"op": "promote", "name": _name_of(src),
                                       "manifest": base64.b64encode(source.manifest_raw).decode()})
        replies = self.channel.replies(self._conn, STREAM, n, self.timeout_s)
        _judge(step, dst, replies, self.channel.world_size, self.timeout_s)
        self.channel.forget(self._conn, STREAM, n, replies=True)
        for f in files:  # each rank's ok is its own writer's commit; a size check costs a HEAD
            info = dst.stat(f.name)
            if info is None or info.size != f.size:
                raise StorageError(f"{dst.url_of(f.name)}: {'missing' if info is None else f'{info.size} bytes'} "
                                   f"after rank {f.rank} reported it uploaded ({f.size} bytes)",
                                   hint="the next tier lost a write; the promotion is retried")
        commit_copy(dst, source)  # the marker last
        copied = sum(int(v.split(":", 1)[1] or 0) for v in replies.values())
        return CopyResult(src.url, dst.url, step, "copied", files=len(files), bytes_copied=copied,
                          seconds=time.perf_counter() - t0)

    def close(self) -> None:
        """Tell every rank's upload thread to end (after the round it is in, if any)."""
        self.channel.send(STREAM, {"op": "stop"})


def _judge(step: int, dst: Storage, replies: dict[int, str], world_size: int, timeout_s: float) -> None:
    """Raise unless every rank replied ok: a damaged shard gives the step up; anything else is
    retried."""
    bad = {k: v[4:] for k, v in replies.items() if v.startswith("bad:")}
    if bad:
        k = min(bad)
        raise InvalidCheckpoint(f"step {step}: rank {k} could not upload its shard to {dst.url}: {bad[k]}",
                                hint="that node's first tier is damaged; a newer checkpoint will be promoted")
    missing = [k for k in range(world_size) if k not in replies]
    if missing:
        raise CoordinationError(f"step {step}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                                f"did not report its upload to {dst.url} within {timeout_s:.0f} s; no marker was written")
    retry = {k: v[6:] for k, v in replies.items() if v.startswith("retry:")}
    if retry:
        k = min(retry)
        raise StorageError(f"step {step}: rank {k} could not upload to {dst.url}: {retry[k]}",
                           hint="the promotion is retried with backoff")


class RoundWorker:
    """Every rank's side: a thread that uploads this rank's shards for each round."""

    def __init__(self, channel: Channel, local: Storage, remote: Storage) -> None:
        self.channel, self.local, self.remote = channel, local, remote
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name=f"ckptctl-upload-{remote.url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = self.channel.connection()
        n = 0
        while True:
            n += 1
            msg = self.channel.receive(conn, STREAM, n)
            if msg is None or msg.get("op") != "promote":
                return
            self.channel.reply(conn, STREAM, n, self._upload(msg))
            self.rounds = n

    def _upload(self, msg: dict[str, Any]) -> str:
        name = str(msg["name"])
        try:
            src, dst = self.local.sub(name), self.remote.sub(name)
            manifest = Manifest.from_json(base64.b64decode(msg["manifest"]), src.url_of("manifest"))
            mine = [f for f in manifest.files if f.rank == self.channel.rank]
            done = upload_files(src, dst, manifest, mine)
            return f"ok:{done.bytes}"
        except OperationalError as e:
            return f"retry:{e}"
        except CkptError as e:
            return f"bad:{e}"
        except Exception as e:  # a bug must not end this rank's part in promotion: rank 0 gives the step up
            log.error("upload of %s to %s failed unexpectedly", name, self.remote.url, exc_info=e)
            return f"bad:unexpected {type(e).__name__}: {e}"

    def join(self, timeout: float) -> bool:
        """Wait for rank 0's stop (or the store's end); True when the thread ended (else it is
        left blocked in the store on its daemon thread)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
