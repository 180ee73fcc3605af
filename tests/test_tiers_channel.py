"""The tiers channel under faults (issue 31), in one process: a real c10d ``TCPStore``, the real
worker threads of several "ranks" (one ``Channel`` each), moto S3 behind the fault proxy, and
the store's connections through a TCP proxy that can reset them (``tcp_fault_proxy.py``).

* A node's keeper survives its store connection being reset, says so in ``health`` while
  it cannot reconnect, and applies the next message once the store is back.
* A replica round rank 0 stopped waiting for is still read by a rank that gets there late.
* 200 promotion rounds that fail (S3 503s, a damaged shard, a dead rank that comes back)
  leave the store with a bounded number of keys, and no thread, file descriptor or
  temporary file behind.
(Two "nodes" under torchrun: ``test_tiers_nodes.py``, ``test_tiers_replicas.py``.)
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint, OperationalError
from ckptctl.format.layout import step_dir
from ckptctl.layouts.native_read import read_committed_raw
from ckptctl.storage import open_storage
from ckptctl.tiers import channel as channel_mod
from ckptctl.tiers import link as link_mod
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.durability import Durability
from ckptctl.tiers.health import Health
from ckptctl.tiers.node_keeper import NodeKeeper, NodeMessages
from ckptctl.tiers.node_retention import PrunePlan
from ckptctl.tiers.promotion_round import RoundLeader, RoundWorker
from ckptctl.tiers.replica import ReplicaWorker, announce
from ckptctl.tiers.replica_link import Ring
from ckptctl.tiers.link import Link
from ckptctl.tiers.stream import GIVEN_UP, Outbox, StreamWorker
from helpers import tmpfs
from tcp_fault_proxy import TcpFaultProxy
from test_tiers import _until, records  # noqa: F401  (a fixture)
from tier_node_workers import free_port
from tier_workers import state_for


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A c10d store of our own, which every ``Channel`` built in the test uses."""
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    monkeypatch.setattr(link_mod, "POOL", link_mod._Pool())
    monkeypatch.setattr(channel_mod, "_default_store", lambda: master)
    yield master


def _saved(root: str, steps: tuple[int, ...]) -> None:
    ck = Checkpointer(root)
    for step in steps:
        ck.save(step, state_for(step, 0)).wait()
    ck.close()


def _commit_message(src: str, step: int) -> dict:
    c = read_committed_raw(open_storage(src).sub(step_dir(step)))
    return {"op": "commit", "name": step_dir(step), "manifest": base64.b64encode(c.manifest_raw).decode(),
            "marker": base64.b64encode(c.marker_raw).decode()}


def test_a_node_keeper_survives_its_store_connection_being_reset(tmp_path, store, monkeypatch) -> None:
    src, node1 = str(tmp_path / "src"), str(tmp_path / "node1")
    _saved(src, (5, 6))
    proxy = TcpFaultProxy(store.port)
    via_proxy = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=3))
    monkeypatch.setattr(channel_mod, "_default_store", lambda: via_proxy)
    health = Health()
    keeper = NodeKeeper(Channel("faults", 1, 2, health), open_storage(node1), {1})  # node 1's leader
    rank0 = dist.PrefixStore("ckptctl-tiers/faults/", store)  # rank 0's side, as NodeMessages writes it
    try:
        rank0.set("node/1", json.dumps(_commit_message(src, 5)))
        _until(lambda: os.path.exists(os.path.join(node1, step_dir(5), "COMMITTED")), "step 5 committed on node 1")
        time.sleep(0.2)  # the keeper's wait for message 2 is in flight
        proxy.refuse = True  # the store's host is unreachable for a while
        assert proxy.cut() >= 1
        _until(lambda: health.troubles(), "the keeper's trouble recorded")
        (t,) = health.troubles()
        assert "node keeper" in t.worker and t.tier == open_storage(node1).url and not t.dead, t
        assert "c10d store is unreachable" in t.why, t
        proxy.refuse = False
        rank0.set("node/2", json.dumps(_commit_message(src, 6)))
        _until(lambda: os.path.exists(os.path.join(node1, step_dir(6), "COMMITTED")), "step 6 committed after the outage")
        _until(lambda: rank0.check(["node/2/r1"]), "the keeper's reply to message 2")
        assert health.troubles() == ()
        rank0.set("node/3", json.dumps({"op": "stop"}))
        assert keeper.join(10)
    finally:
        proxy.close()


def test_a_keeper_that_ends_unexpectedly_is_reported_once_and_restarted(tmp_path, store, records) -> None:
    """A message the keeper cannot even decode (a bug's stand-in: the thread ends) is recorded
    in ``health`` as dead, announced once (what ``save()`` logs), and ``revive`` (what
    ``save()`` calls) starts it again; a message that ends it twice is skipped, and the next
    one is applied: node retention never stops for good."""
    src, node1 = str(tmp_path / "src"), str(tmp_path / "node1")
    _saved(src, (5,))
    health = Health()
    keeper = NodeKeeper(Channel("poison", 1, 2, health), open_storage(node1), {1})
    rank0 = dist.PrefixStore("ckptctl-tiers/poison/", store)
    rank0.set("node/1", b"\xff not json")
    _until(lambda: not keeper.alive, "the keeper ended")
    (t,) = health.troubles()
    assert t.dead and "node keeper" in t.worker, t
    assert [x.worker for x in health.unannounced()] == [t.worker] and health.unannounced() == ()
    assert keeper.revive()
    _until(lambda: not keeper.alive, "the keeper ended again at the same message")
    assert health.unannounced() == ()  # announced once
    rank0.set("node/2", json.dumps(_commit_message(src, 5)))
    assert keeper.revive()
    _until(lambda: os.path.exists(os.path.join(node1, step_dir(5), "COMMITTED")), "the next message applied")
    rank0.set("node/3", json.dumps({"op": "stop"}))
    assert keeper.join(10)


def test_a_replica_round_stays_for_a_rank_that_reads_it_late(tmp_path, store, records) -> None:
    """The collecting rank waits 0.5 s for round 1's replies, and its partner's thread is not
    there yet (busy with an earlier round, in a real job). The announcement must still be
    there when it comes: before, it was deleted after that wait, the late rank waited for it
    forever and its partner failed every later round. (The ranks are 1 and 2 of three, and
    the checkpoints hold rank 0's shard only: nothing travels over gloo, which one process
    cannot stand in for; the test is about the announcements.)"""
    src = str(tmp_path / "src")
    _saved(src, (5, 6))
    ring = Ring(((1,), (2,)))
    ch1, ch2 = Channel("replicas", 1, 3), Channel("replicas", 2, 3)
    out = ch1.outbox("replica", {1, 2}, 16, collected=True)  # rank 0's side, here on rank 1
    w1 = ReplicaWorker(ch1, None, ring, open_storage(str(tmp_path / "n1")), 0.5, Durability(), out)
    raw = {s: read_committed_raw(open_storage(src).sub(step_dir(s))).manifest_raw for s in (5, 6)}
    announce(out, step_dir(5), raw[5])
    _until(lambda: records.count(f"peer replica of {step_dir(5)} incomplete"), "round 1 collected without rank 2")
    w2 = ReplicaWorker(ch2, None, ring, open_storage(str(tmp_path / "n2")), 0.5)  # rank 2 gets there now
    announce(out, step_dir(6), raw[6])
    _until(lambda: w2.rounds == 2 and w1.rounds == 2, "rank 2 read both rounds", 30)
    out.finish(out.stop(), 10)
    assert w1.join(10) and w2.join(10)
    assert store.num_keys() == 0


class _Echo(StreamWorker):
    ops = frozenset({"go"})

    def handle(self, n: int, msg: dict) -> str:
        return f"ok:{msg['i']}"


def test_a_receiver_about_to_wait_for_a_message_rank_0_gave_up_takes_the_next(store) -> None:
    """A receiver reads the floor, then waits for its next message; rank 0 may give that message
    up in between (a newer one of a latest-only stream, as every promotion round after one a
    rank missed). The receiver's wait, held here between its two requests, reaches the store
    only after the message was deleted: it waited an hour (``WAIT_S``) for a message that would
    never come, and every round meanwhile waited out its deadline for its reply."""
    proxy = TcpFaultProxy(store.port)
    via_proxy = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, wait_for_workers=False)
    sender = Link(store, "race/", "sender", "", None)
    out = Outbox(sender, "s", {1}, keep=4, collected=True, latest_only=True)
    release = proxy.hold(b"s/1")  # the receiver's wait for message 1
    receiver = _Echo(Link(via_proxy, "race/", "receiver", "", None), "s", 1, None)
    receiver.start()
    try:
        _until(lambda: proxy._held is None, "the receiver waiting for message 1", 30)
        out.send({"op": "go", "i": 1})
        n = out.send({"op": "go", "i": 2})  # gives up message 1: the receiver never took it
        release.set()
        assert out.replies(sender, n, 30) == {1: "ok:2"}
    finally:
        release.set()
        out.finish(out.stop(), 10)
        receiver.join(10)
        proxy.close()
    assert not receiver.alive
    assert store.num_keys() <= 3  # the stream's own and the store's; nothing of the messages


def test_a_receiver_waiting_for_a_message_closed_unfinished_takes_stop(store) -> None:
    """Rank 0 closes the stream while a receiver has not finished message 1: its wait for it,
    held here between its two requests, reaches the store after ``finish`` (its wait for the
    ``stop`` reply over) dealt with message 1. Deleted, the message left the receiver's thread
    waiting an hour (``WAIT_S``); a tombstone wakes it to read the floor, take ``stop`` and end.
    What stays: the floor, ``stop``, its reply and the tombstone, nothing more."""
    proxy = TcpFaultProxy(store.port)
    via_proxy = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, wait_for_workers=False)
    sender = Link(store, "closing/", "sender", "", None)
    out = Outbox(sender, "s", {1}, keep=4, collected=True)
    release = proxy.hold(b"s/1")  # the receiver's wait for message 1
    receiver = _Echo(Link(via_proxy, "closing/", "receiver", "", None), "s", 1, None)
    receiver.start()
    try:
        _until(lambda: proxy._held is None, "the receiver waiting for message 1", 30)
        before = store.num_keys()
        out.send({"op": "go", "i": 1})
        out.finish(out.stop(), 0.5)  # the receiver did not take stop in time
        release.set()
        assert receiver.join(30), "the receiver still waits for message 1"
        assert receiver.rounds == 0  # message 1 was given up, not handled
        keys = dist.PrefixStore("closing/", store)
        # A set is not answered: the reply may still be on its way through the proxy's thread.
        _until(lambda: keys.check(["s/2/r1"]), "the receiver's reply to stop reaching the store", 30)
        assert keys.get("s/2/r1") == b"stopped"
        assert keys.get("s/1") == GIVEN_UP and keys.get("s/floor") == b"2" and keys.check(["s/2"])
        assert store.num_keys() - before == 3  # stop, its reply, the tombstone (the floor was there)
    finally:
        release.set()
        proxy.close()


def test_store_keys_threads_and_files_stay_bounded_through_200_failed_rounds(tmp_path, store, monkeypatch) -> None:
    """Two ranks, promoting to a next tier that is a real 1 MiB tmpfs. Rank 1 is dead for the
    first rounds (its heartbeat counter stands still and its threads are not there); it comes
    back; then the next tier is full for 150 rounds, a damaged shard fails 45 more, and room
    is made. Node messages flow at every round. The store never holds more than a few dozen
    keys (one stream's open messages), and none once closed; no thread, file descriptor or
    temporary file is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)
    src = str(tmp_path / "src")
    _saved(src, (1, 2, 3))
    threads = {t.name for t in threading.enumerate()}
    fds = len(os.listdir("/proc/self/fd"))
    with tmpfs("1m") as next_tier:
        remote = open_storage(next_tier)
        ch0, ch1 = Channel("keys", 0, 2), Channel("keys", 1, 2)
        beats = dist.PrefixStore("ckptctl/keys/", store)  # the save heartbeat's counters (docs/protocol.md)
        beats.add("alive/1", 1)  # rank 1 beat once, then died
        leader = RoundLeader(ch0, remote, liveness_s=0.5)
        node = NodeMessages(ch0, {0, 1})
        workers = [RoundWorker(ch0, open_storage(src), remote), NodeKeeper(ch0, open_storage(str(tmp_path / "n0")), {0})]
        most = 0

        def round_(step: int, fails: type[Exception] | None) -> None:
            nonlocal most
            node.prune(PrunePlan(step_dir(step), ()))
            if fails is None:
                leader.copy(open_storage(src).sub(step_dir(step)), remote.sub(step_dir(step)))
            else:
                with pytest.raises(fails):
                    leader.copy(open_storage(src).sub(step_dir(step)), remote.sub(step_dir(step)))
            most = max(most, store.num_keys())

        try:
            ballast = os.path.join(next_tier, "ballast")
            with open(ballast, "wb") as f:  # the next tier is full
                try:
                    f.write(b"\0" * (2 << 20))
                except OSError:
                    pass
            for _ in range(5):
                round_(1, OperationalError)  # rank 1 dead: answered for by the heartbeat watch
            beats.delete_key("alive/1")  # rank 1 is back (a relaunched rank beats from nothing)
            workers += [RoundWorker(ch1, open_storage(src), remote),
                        NodeKeeper(ch1, open_storage(str(tmp_path / "n1")), {1})]
            for _ in range(150):
                round_(1, OperationalError)
            os.remove(ballast)
            shard = os.path.join(src, step_dir(2), "rank-00000-of-00001.safetensors")
            with open(shard, "r+b") as f:
                f.seek(-5, os.SEEK_END)
                f.write(b"\xff")
            for _ in range(45):
                round_(2, InvalidCheckpoint)
            round_(3, None)
            assert os.path.exists(os.path.join(next_tier, step_dir(3), "COMMITTED"))
        finally:
            leader.close(10)
            node.outbox.finish(node.stop(), 10)
            node.forget()
            for w in workers:
                assert w.join(10)
            ch0.close()
            ch1.close()
    assert most <= 40, most
    assert store.num_keys() == 0
    left = [t.name for t in threading.enumerate() if t.name.startswith("ckptctl") and t.name not in threads]
    assert left == []
    # Connections kept: the pool's (for the next Checkpointer) and the leader's own two; each
    # is two descriptors here, the store's end being in this process too. None per round.
    assert len(os.listdir("/proc/self/fd")) - fds <= 2 * (len(link_mod.POOL._idle) + 2)
    assert os.listdir(tempfile.tempdir) == []


class _Interleaved(dist.Store):
    """A connection to a real store (torch's own ``TCPStore``: every request goes over TCP)
    that runs ``after_append`` right after each ``append`` it sends: what another rank can do
    while this one's thread is descheduled between two requests on a loaded host."""

    def __init__(self, inner: dist.Store, after_append) -> None:
        super().__init__()
        self.inner, self.after_append = inner, after_append

    def clone(self) -> "_Interleaved":
        return _Interleaved(self.inner.clone(), self.after_append)

    def append(self, key: str, value) -> None:
        self.inner.append(key, value)
        self.after_append(key)

    def set(self, key, value):
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        return self.inner.multi_get(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self.inner.check(keys)


def test_an_exchange_goes_on_when_the_last_reader_deleted_the_keys_between_two_requests(store, monkeypatch) -> None:
    """Node-local tiers exchange each rank's node when the ``Checkpointer`` is built; the last
    rank to read them all deletes them. Rank 1 appends itself to the readers; before it reads
    that list back, rank 0 appends, sees both and deletes the keys. On 821c4f4 rank 1 then
    blocked in a ``get`` of the deleted list until the store's timeout (30 min by default, here
    3 s) and its Checkpointer failed (under torchrun: every other rank waits in its first save
    meanwhile, the whole job silent)."""
    ch0_done = threading.Event()
    monkeypatch.setattr(channel_mod, "_default_store", lambda: store)
    ch0 = Channel("interleaved", 0, 2)
    dist.PrefixStore("ckptctl-tiers/interleaved/", store).set("nodes/0", "node-0")  # rank 0's first request, early
    got: dict[int, object] = {}

    def rank(r: int, ch: Channel) -> None:
        try:
            got[r] = ch.exchange("nodes", f"node-{r}", 30)
        except Exception as e:  # noqa: BLE001  (the test reports what the rank raised)
            got[r] = e
        if r == 0:
            ch0_done.set()

    def rank0_runs_whole(key: str) -> None:  # between rank 1's append and its read
        if key.endswith("nodes/read"):
            threading.Thread(target=rank, args=(0, ch0)).start()
            assert ch0_done.wait(30), "rank 0's exchange did not end"

    slow = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=3))
    monkeypatch.setattr(channel_mod, "_default_store", lambda: _Interleaved(slow, rank0_runs_whole))
    ch1 = Channel("interleaved", 1, 2)
    rank(1, ch1)
    assert ch0_done.wait(30)
    assert got == {0: ["node-0", "node-1"], 1: ["node-0", "node-1"]}, got
    assert store.num_keys() == 0  # and nothing left behind
    ch0.close(), ch1.close()
