"""Multi-rank saves and re-sharding loads with real processes on gloo (CPU).

The worker side of every scenario is in ``dist_workers.py``; each test launches 1 to 4 real
ranks, which talk over TCP on localhost, and inspects what they return and what they wrote.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from ckptctl.layouts.native_read import read_committed, read_header
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.save.shard_layout import assign_replicated
from ckptctl.storage import open_storage
from dist_workers import launch
from helpers import cli


def _ok(results: dict) -> dict:
    for r, res in results.items():
        assert "error" not in res and "exit" not in res, f"rank {r}: {res.get('error') or res}\n{res.get('traceback', '')}"
    return results


def _headers(ckpt_path: str) -> dict:
    ckpt = open_storage(ckpt_path)
    manifest, _ = read_committed(ckpt)
    return {f.name: read_header(ckpt, f.name) for f in manifest.files}


@pytest.mark.slow
def test_save_at_4_load_at_3_2_1_and_back_to_4_fsdp2_and_ddp(tmp_path):
    root, ref = str(tmp_path / "root"), str(tmp_path / "ref.pt")
    out = lambda name: str(tmp_path / name)  # noqa: E731

    # FSDP2 at 4 ranks (uneven and empty shards: 7 and 3 rows), AdamW; save at step 3.
    saved = _ok(launch("train_save", 4, {"mode": "fsdp", "root": root, "save_step": 3, "ref": ref}, out("a")))
    losses = saved[0]["losses"]

    # Same world size, fresh init: state bitwise equal, and training continues identically.
    same = _ok(launch("load_check", 4, {"mode": "fsdp", "root": root, "ref": ref, "train_from": 4}, out("b")))
    for r, res in same.items():
        assert res["step"] == 3 and res["bad"] == [], (r, res["bad"])
        assert res["losses"] == losses
        assert res["extra"] == {"rank": r, "note": f"r{r}"}  # per-rank state is each rank's own

    # 4 -> 3 (FSDP2), then saved again by 3 ranks.
    three = _ok(launch("load_check", 3, {"mode": "fsdp", "root": root, "ref": ref, "resave": 10}, out("c")))
    assert all(res["bad"] == [] and res["extra"]["rank"] == r for r, res in three.items())

    # FSDP2 at 3 -> DDP at 2, saved again by DDP (replicated: every tensor written once).
    two = _ok(launch("load_check", 2, {"mode": "ddp", "root": root, "ref": ref, "resave": 20}, out("d")))
    assert all(res["step"] == 10 and res["bad"] == [] for res in two.values())

    # DDP at 2 -> one process, saved again by that one rank.
    one = _ok(launch("load_check", 1, {"mode": "plain", "root": root, "ref": ref, "resave": 30}, out("e")))
    assert one[0]["step"] == 20 and one[0]["bad"] == []

    # 1 -> 4, back to FSDP2: bitwise equal, and training from here reproduces the first run.
    four = _ok(launch("load_check", 4, {"mode": "fsdp", "root": root, "ref": ref, "train_from": 4}, out("f")))
    for r, res in four.items():
        assert res["step"] == 30 and res["bad"] == []
        assert res["losses"] == losses
        assert res["extra"]["rank"] == 0  # saved by one rank: every rank gets rank 0's copy

    assert cli("verify", root, "--all", "--json").exit_code == 0

    # Replicated tensors (DDP's parameters, optimizer steps) are in exactly one shard, and
    # the writing is spread: no shard holds more than its share plus the largest tensor.
    headers = _headers(os.path.join(root, step_dir(20)))
    seen: dict[str, int] = {}
    for h in headers.values():
        for c in h.chunks:
            seen[c.name] = seen.get(c.name, 0) + 1
    assert seen and all(n == 1 for n in seen.values())
    sizes = [h.data_size for h in headers.values()]
    largest = max(c.nbytes for h in headers.values() for c in h.chunks)
    assert max(sizes) <= sum(sizes) / len(sizes) + largest
    assert min(sizes) > 0
    # FSDP2 at 4: the scalar "step" of each parameter's AdamW state is written once too.
    fsdp4 = _headers(os.path.join(root, step_dir(3)))
    steps = [c.name for h in fsdp4.values() for c in h.chunks if c.name.endswith("/step")]
    assert len(steps) == len(set(steps)) == 6


def _assert_step_2_lost(res: dict, root: str, survivors: tuple[int, ...], says: str, waited: tuple[float, float]) -> None:
    """``kill_mid_write``'s outcome: every survivor's save of step 2 failed, saying ``says``,
    after a wait within ``waited``; no marker; step 1 is still the latest checkpoint."""
    for r in survivors:
        error = res[r]["error"]
        assert res[r]["first"].endswith(step_dir(1))
        assert error.startswith("SaveFailed") and "no marker was written" in error, error
        assert says in error, error
        assert waited[0] < res[r]["waited"] < waited[1]
    assert not os.path.exists(os.path.join(root, step_dir(2), MARKER))
    latest = cli("latest", root, "--json")
    assert latest.exit_code == 0 and step_dir(1) in latest.stdout


@pytest.mark.slow
def test_rank_killed_mid_write_fails_the_save_on_every_survivor_within_the_timeout(tmp_path):
    root = str(tmp_path / "root")
    res = launch("kill_mid_write", 3, {"root": root, "victim": 1, "timeout_s": 8, "linger": 4}, str(tmp_path / "out"))
    assert res[1] == {"exit": -9}
    # Every survivor names the lost rank (rank 0 found it, told the others).
    _assert_step_2_lost(res, root, (0, 2), "rank 1 did not report", waited=(0, 8 + 8))


@pytest.mark.slow
def test_rank_hung_mid_write_fails_the_save_on_every_other_rank_after_the_timeout(tmp_path):
    root = str(tmp_path / "root")
    res = launch("kill_mid_write", 3, {"root": root, "victim": 2, "timeout_s": 4, "how": "hang", "linger": 4}, str(tmp_path / "out"))
    assert res[2] == {"exit": 3}
    # Bounded by the timeout, not by the hung rank.
    _assert_step_2_lost(res, root, (0, 1), "rank 2 did not report within 4s", waited=(3, 4 + 8))


@pytest.mark.slow
def test_killed_rank_is_found_by_its_missing_heartbeat_long_before_the_timeout(tmp_path):
    root = str(tmp_path / "root")
    args = {"root": root, "victim": 1, "timeout_s": 120, "liveness_s": 3, "linger": 4}
    res = launch("kill_mid_write", 3, args, str(tmp_path / "out"))
    assert res[1] == {"exit": -9}
    # liveness_s and a beat or two, not timeout_s.
    _assert_step_2_lost(res, root, (0, 2), "rank 1 did not report: no heartbeat for 3s", waited=(0, 40))


@pytest.mark.slow
def test_rank_hung_but_alive_keeps_its_heartbeat_and_is_caught_by_the_timeout(tmp_path):
    root = str(tmp_path / "root")
    args = {"root": root, "victim": 2, "timeout_s": 8, "liveness_s": 2, "how": "hang", "linger": 4}
    res = launch("kill_mid_write", 3, args, str(tmp_path / "out"))
    assert res[2] == {"exit": 3}  # it slept through 3 timeouts: never declared dead meanwhile
    _assert_step_2_lost(res, root, (0, 1), "rank 2 did not report within 8s", waited=(7, 8 + 8))
    assert all("heartbeat" not in res[r]["error"] for r in (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["rank0", "launcher"])
def test_killed_rank_0_fails_the_save_on_every_other_rank_long_before_the_timeout(tmp_path, store):
    # "rank0": tcp:// init, the store dies with rank 0 and the others' store calls fail at once.
    # "launcher": the store outlives rank 0 (as torchrun's agent's does): its heartbeat stops.
    root = str(tmp_path / "root")
    args = {"root": root, "victim": 0, "timeout_s": 120, "liveness_s": 3, "store": store}
    res = launch("kill_mid_write", 3, args, str(tmp_path / "out"))
    assert res[0] == {"exit": -9}
    why = "no heartbeat from rank 0 for 3s" if store == "launcher" else "the c10d store failed"
    _assert_step_2_lost(res, root, (1, 2), why, waited=(0, 40))
    assert all("rank 0 (the coordinator)" in res[r]["error"] for r in (1, 2))


@pytest.mark.slow
def test_failed_write_names_the_rank_on_every_rank_and_the_next_save_commits(tmp_path):
    root = str(tmp_path / "root")
    res = _ok(launch("failing_write", 3, {"root": root, "victim": 2}, str(tmp_path / "out")))
    first = {r["first"] for r in res.values()}
    assert len(first) == 1  # every rank raises the same error
    (msg,) = first
    assert msg.startswith("SaveFailed") and "rank 2 failed" in msg and "Is a directory" in msg
    assert not os.path.exists(os.path.join(root, step_dir(5), MARKER))
    assert all(r["second"].endswith(step_dir(6)) for r in res.values())
    # A committed step is never overwritten, and every rank refuses alike.
    assert all(r["again"].startswith("RefusedForSafety") for r in res.values())


@pytest.mark.slow
@pytest.mark.parametrize("fault, raised, reported", [
    # state_dict() raises on rank 1 only: before, rank 1 raised in save() and the others
    # waited out timeout_s (here 120 s) in the barrier, with the round counters out of step.
    ("state_dict", "TypeError", "state_dict() of the victim failed"),
    # a tensor that cannot be copied (meta) on rank 1 only, refused naming its key
    ("meta_tensor", "StateError", "'bad'"),
    # rank 1's storage raises a type no storage should raise, on the writer thread
    ("storage", None, "KeyError"),
])
def test_a_fault_on_one_rank_fails_every_rank_at_once_and_the_next_save_commits(tmp_path, fault, raised, reported):
    root = str(tmp_path / "root")
    res = _ok(launch("raising_state", 3, {"root": root, "victim": 1, "timeout_s": 120, "fault": fault}, str(tmp_path / "out")))
    if raised is not None:  # raised by save() itself, on the rank where it happened
        assert res[1]["first"].startswith(raised) and reported in res[1]["first"], res[1]
    others = (0, 2) if raised is not None else (0, 1, 2)
    for r in others:
        assert "rank 1 failed" in res[r]["first"] and reported in res[r]["first"], res[r]
        assert res[r]["waited"] < 30, res[r]
    assert not os.path.exists(os.path.join(root, step_dir(5), MARKER))
    assert all(r["second"].endswith(step_dir(6)) for r in res.values())


@pytest.mark.slow
def test_new_group_is_not_blocked_by_a_save_waiting_in_its_barrier(tmp_path):
    root = str(tmp_path / "root")
    res = _ok(launch("new_group_during_barrier", 2, {"root": root, "delay": 8.0}, str(tmp_path / "out")))
    assert res[0]["url"] == res[1]["url"] == os.path.join(root, step_dir(1))
    # Rank 1 starts its save ~7 s after rank 0 created the group: a blocked new_group takes that long.
    assert res[0]["new_group_s"] < 4.0, res[0]


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumed_on_two_ranks_warns_that_rank_1_gets_rank_0s_state(tmp_path):
    import torch

    from ckptctl import Checkpointer

    root = str(tmp_path / "root")
    with Checkpointer(root) as ckpt:  # one process, no process group: a 1-rank checkpoint
        ckpt.save(3, {"w": torch.arange(4.0), "extra": {"pos": 17}}).wait()
    res = _ok(launch("load_warnings", 2, {"root": root}, str(tmp_path / "out")))
    assert res[0]["step"] == res[1]["step"] == 3
    assert res[0]["extra"] == res[1]["extra"] == {"pos": 17}
    assert not any("rank 0's" in w for w in res[0]["warnings"]), res[0]["warnings"]
    assert any("rank 1" in w and "rank 0's copy of extra" in w for w in res[1]["warnings"]), res[1]["warnings"]
    assert any("RNG state of rank 1" in w for w in res[1]["warnings"]), res[1]["warnings"]


@pytest.mark.slow
def test_a_2_to_4_reshard_says_which_ranks_carry_their_own_state_and_the_load_agrees(tmp_path):
    """Issue 30: loading a 2 -> 4 reshard warned "rank 3 ... has no state saved by rank 3 (saved
    by 4 ranks)". Now reshard says which ranks carry their own per-rank state, its manifest
    records it, and the load's warning says why ranks 2 and 3 get rank 0's copy."""
    src_root, dst_root = str(tmp_path / "src"), str(tmp_path / "dst")
    _ok(launch("save_per_rank", 2, {"root": src_root}, str(tmp_path / "out1")))
    dst = os.path.join(dst_root, step_dir(5))
    r = cli("reshard", os.path.join(src_root, step_dir(5)), dst, "--world-size", "4")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "ranks 0-1 carry their own" in r.stderr and "ranks 2-3 did not exist in the 2-rank job" in r.stderr, r.stderr
    with open(os.path.join(dst, "manifest.json")) as f:
        assert json.load(f)["extra"]["resharded_from"]["rank_state_from_rank_0"] == [2, 3]
    res = _ok(launch("load_warnings", 4, {"root": dst_root}, str(tmp_path / "out2")))
    assert [res[k]["extra"]["pos"] for k in range(4)] == [100, 101, 100, 100]
    for k in (2, 3):
        said = [w for w in res[k]["warnings"] if "rank 0's copy of extra" in w]
        assert said and "resharded from 2 to 4 ranks" in said[0] and "saved by 4 ranks" not in said[0], said
    assert not any("rank 0's copy" in w for k in (0, 1) for w in res[k]["warnings"])


@pytest.mark.slow
def test_saves_in_flight_commit_one_after_another_never_mixed(tmp_path):
    root = str(tmp_path / "root")
    res = _ok(launch("back_to_back", 2, {"root": root}, str(tmp_path / "out")))
    assert res[0]["paths"] == res[1]["paths"] == [os.path.join(root, step_dir(s)) for s in range(1, 5)]
    # Planning is cached: the coverage collective ran for the first save only.
    assert res[0]["plan_rounds"] == res[1]["plan_rounds"] == [1]
    for s in range(1, 5):
        manifest, _ = read_committed(open_storage(os.path.join(root, step_dir(s))))
        assert manifest.step == s and manifest.world_size == 2 and len(manifest.files) == 2
    assert cli("verify", root, "--all", "--json").exit_code == 0


@pytest.mark.slow
def test_2d_sharded_hsdp_and_replicated_dtensors_reshard_to_1d_and_to_plain(tmp_path):
    root = str(tmp_path / "root")
    saved = _ok(launch("dtensor_layouts", 4, {"root": root, "phase": "save"}, str(tmp_path / "a")))
    manifest, _ = read_committed(open_storage(saved[0]["path"]))
    # 2x2 blocks; one of the two replicas of each HSDP shard; the replicated tensor once.
    assert {n: t.chunks for n, t in manifest.tensors.items()} == {"tp": 4, "hsdp": 2, "rep": 1}
    for ws, name in ((3, "b"), (1, "c")):
        res = _ok(launch("dtensor_layouts", ws, {"root": root, "phase": "load"}, str(tmp_path / name)))
        assert all(r["equal"] == {"tp": True, "hsdp": True, "rep": True} for r in res.values()), res


@pytest.mark.slow
def test_shape_mismatch_names_the_tensor_and_strict_false_loads_the_rest(tmp_path):
    root, ref = str(tmp_path / "root"), str(tmp_path / "ref.pt")
    saved = _ok(launch("train_save", 2, {"mode": "fsdp", "root": root, "save_step": 1, "ref": ref}, str(tmp_path / "a")))
    res = _ok(launch("mismatch", 2, {"root": root, "ref": ref, "path": saved[0]["path"]}, str(tmp_path / "b")))
    for r in res.values():
        assert "model/a.weight" in r["strict"] and "[7, 5]" in r["strict"] and "[9, 5]" in r["strict"]
        assert "model/a.weight" in r["skipped"] and "model/b.weight" in r["skipped"]
        assert "model/c.weight" not in r["skipped"]
        assert r["c_equal"]  # what matched was loaded


@pytest.mark.slow
def test_corruption_seen_by_one_rank_moves_every_rank_to_the_older_checkpoint(tmp_path):
    root, ref = str(tmp_path / "root"), str(tmp_path / "ref.pt")
    saved = _ok(launch("two_saves", 2, {"root": root, "ref": ref}, str(tmp_path / "a")))
    # Flip a byte of rank 1's piece of one FSDP-sharded weight: only rank 1 reads it back.
    shard = os.path.join(saved[0]["path"], "rank-00001-of-00002.safetensors")
    (chunk,) = [c for c in _headers(saved[0]["path"])["rank-00001-of-00002.safetensors"].chunks if c.name == "model/a.weight"]
    header = read_header(open_storage(saved[0]["path"]), "rank-00001-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.seek(header.data_start + chunk.begin)
        byte = f.read(1)
        f.seek(header.data_start + chunk.begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = _ok(launch("load_check", 2, {"mode": "fsdp", "root": root, "ref": ref}, str(tmp_path / "b")))
    assert res[0]["step"] == res[1]["step"] == 1  # both ranks, not only the one that saw it
    assert res[0]["bad"] == res[1]["bad"] == []


@pytest.mark.slow
def test_each_rank_resumes_its_own_data_loader_position(tmp_path):
    root = str(tmp_path / "root")
    saved = _ok(launch("loader_positions", 2, {"root": root, "phase": "save"}, str(tmp_path / "a")))
    assert saved[0]["next"] != saved[1]["next"]
    resumed = _ok(launch("loader_positions", 2, {"root": root, "phase": "load"}, str(tmp_path / "b")))
    assert {r: v["next"] for r, v in resumed.items()} == {r: v["next"] for r, v in saved.items()}


@pytest.mark.slow
def test_process_group_selects_the_ranks_that_checkpoint_together(tmp_path):
    root = str(tmp_path / "root")
    res = _ok(launch("subgroups", 4, {"root": root}, str(tmp_path / "out")))
    for r, got in res.items():
        assert got["path"] == os.path.join(root, f"group{r // 2}", step_dir(1))
        assert (got["rank"], got["world_size"]) == (r % 2, 2)
        assert got["w_ok"] and got["extra"] == {"rank": r}
    for g in (0, 1):
        manifest, _ = read_committed(open_storage(os.path.join(root, f"group{g}", step_dir(1))))
        assert manifest.world_size == 2 and manifest.tensors["w"].chunks == 1


def test_replicated_tensors_are_assigned_by_size_deterministically():
    sizes = {f"t{i}": (i * 37) % 101 + 1 for i in range(200)}
    a = assign_replicated(sizes, 7)
    assert a == assign_replicated(dict(reversed(list(sizes.items()))), 7)  # order does not matter
    loads = [sum(sizes[n] for n, r in a.items() if r == k) for k in range(7)]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert assign_replicated({"x": 5}, 1) == {"x": 0}


def _report(rank: int, step: int = 7, *, error: str | None = None, structure: str = "s", replanned: bool = False) -> dict:
    from dataclasses import asdict

    from ckptctl.format.manifest import FileEntry
    from ckptctl.save.messages import RankReport

    entry = None if error else FileEntry(f"rank-{rank:05d}-of-00004.safetensors", 10, "ab", rank, 1)
    return asdict(RankReport(rank, step, entry, error, structure, replanned, {"bytes": 10.0, "write_s": 0.1 * rank}))


def test_rank0_decides_from_the_reports_alone():
    from types import SimpleNamespace

    from ckptctl.save.coordination import Coordinator

    coord = Coordinator(None, timeout_s=5, rank=0, world_size=4)
    plan = SimpleNamespace(structure="s")
    ok = [_report(r) for r in range(4)]
    assert coord._decide(ok, plan) == ("plan", "")  # nothing checked yet
    coord._structure = "s"
    assert coord._decide(ok, plan) == ("commit", "")  # cached plan: no coverage round
    assert coord._decide(ok[:3] + [_report(3, replanned=True)], plan) == ("plan", "")
    action, msg = coord._decide([_report(0), _report(1, error="disk full"), _report(2), _report(3, error="EIO")], plan)
    assert action == "fail" and "ranks 1, 3 failed" in msg and "rank 1: disk full" in msg and "rank 3: EIO" in msg
    action, msg = coord._decide(ok[:3] + [_report(3, step=8)], plan)
    assert action == "fail" and "different steps [7, 8]" in msg
    action, msg = coord._decide(ok[:2] + [_report(2, structure="t"), _report(3)], plan)
    assert action == "fail" and "rank 2" in msg


def test_messages_are_fixed_size_json_and_long_errors_are_cut_to_fit():
    from ckptctl.save.messages import REPORT_BYTES, pack, unpack

    doc = _report(2, error="x" * 5000 + " \N{UMBRELLA WITH RAIN DROPS}" * 300)
    packed = pack(dict(doc), REPORT_BYTES, shorten="error")
    assert packed.numel() == REPORT_BYTES
    back = unpack(packed)
    assert back["rank"] == 2 and back["error"].startswith("xxx") and back["error"].endswith("[...]")
    assert unpack(pack(_report(1), REPORT_BYTES, shorten="error")) == _report(1)


def _store() -> tuple:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False)
    return server, dist.PrefixStore("ckptctl/t/", client)


def _until(cond, limit: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_heartbeat_wakes_rank_0_naming_the_waited_for_rank_whose_counter_stands_still():
    from ckptctl.save.heartbeat import Heartbeat

    server, st = _store()
    st.append("1/arrived", "0,2,")  # ranks 0 and 2 arrived; rank 1 beat once, then nothing
    st.add("alive/1", 1)
    st.add("alive/2", 1)  # arrived: not watched even though it stands still too
    hb = Heartbeat(st.clone(), 0, 3, liveness_s=0.6)
    try:
        hb.watch = 1
        assert _until(lambda: st.check(["1/all"]))
        assert st.get("1/all") == b"lost:1"
        assert int(st.get("alive/0")) >= 3  # it kept beating meanwhile
    finally:
        hb.stop()
    assert not hb._thread.is_alive()
    beats = int(st.get("alive/0"))
    assert not _until(lambda: int(st.get("alive/0")) != beats, limit=0.6)  # stopped: no more beats


def test_heartbeat_leaves_a_rank_that_keeps_beating_and_an_answer_already_given():
    import threading

    from ckptctl.save.heartbeat import Heartbeat

    server, st = _store()
    st.append("1/arrived", "0,")
    stop = threading.Event()

    def rank1_beats() -> None:  # alive, but not arriving (a hung write)
        while not stop.wait(0.1):
            st.add("alive/1", 1)

    beater = threading.Thread(target=rank1_beats, daemon=True)
    beater.start()
    hb0 = Heartbeat(st.clone(), 0, 2, liveness_s=0.6)
    hb1 = Heartbeat(st.clone(), 1, 2, liveness_s=0.6)  # rank 0 beats: rank 1 never takes it for dead
    st.set("2/answer", "ok:")
    hb0.watch, hb1.watch = 1, 1
    try:
        assert not _until(lambda: st.check(["1/all"]) or st.check(["1/answer"]), limit=2.0)
        hb0.stop()  # rank 0 stops beating: rank 1 sees it within liveness_s, but never overwrites an answer
        hb1.watch = 2
        assert not _until(lambda: st.get("2/answer") != b"ok:", limit=1.5)
        hb1.watch = 1
        assert _until(lambda: st.check(["1/answer"]))
        assert st.get("1/answer") == b"coordinator:0"
    finally:
        stop.set()
        hb0.stop()
        hb1.stop()


def test_heartbeat_survives_a_lost_store_quietly_and_keeps_trying(caplog):
    from ckptctl.save.heartbeat import Heartbeat

    server, st = _store()
    hb = Heartbeat(st.clone(), 1, 2, liveness_s=0.6)
    assert _until(lambda: int(st.get("alive/1")) >= 2)
    with caplog.at_level("WARNING", logger="ckptctl"):
        del server, st  # the store's server goes away: every beat fails from now on
        assert _until(lambda: "heartbeat interrupted" in caplog.text)
        time.sleep(3 * hb.interval)  # more failed beats: still one warning, and no exception
    assert caplog.text.count("heartbeat interrupted") == 1
    assert hb._thread.is_alive()  # a blip must not silence this rank for good
    hb.stop()
    assert not hb._thread.is_alive()


def test_liveness_below_three_shortest_beats_is_refused():
    from ckptctl.errors import UsageError
    from ckptctl.save.coordination import Coordinator

    with pytest.raises(UsageError, match="liveness_s"):
        Coordinator.create(None, 60, liveness_s=0.1)


@pytest.mark.slow
def test_corrupt_byte_in_a_1_rank_checkpoint_loaded_as_shard0_on_2_ranks_falls_back_on_every_rank(tmp_path):
    """Each rank reads half of the saved chunk; the flipped byte is in rank 1's half, so only a
    reader that checks the whole chunk on every rank notices it, and every rank moves on to
    step 1 together."""
    import torch

    from ckptctl import Checkpointer
    from ckptctl.load.reader import CheckpointReader

    root = str(tmp_path / "root")
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    with Checkpointer(root) as ck:  # one process: a 1-rank checkpoint, one chunk per tensor
        for s in (1, 2):
            ck.save(s, {"w": w + 100 * s, "extra": {"step": s}}).wait()
    two = os.path.join(root, step_dir(2))
    with CheckpointReader(open_storage(two)) as r:
        (loc,) = r.chunks("w")
    start, end = loc.byte_range
    at = start + (end - start) * 7 // 8  # row 7: rank 1's half
    with open(os.path.join(two, loc.file), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    res = _ok(launch("shard0_load_latest", 2, {"root": root, "rows": 8, "cols": 6}, str(tmp_path / "out")))
    for r, got in res.items():
        assert got["step"] == 1, (r, got)
        assert got["w"] == (w + 100).tolist() and got["extra"] == {"step": 1}


def _expected_opened(res: dict, rank: int, saved_by: int, loaded_by: int) -> set[str]:
    """The shard files rank ``rank`` of ``loaded_by`` ranks may open: the blocks of the saved
    split that overlap its own block, the owners of whole tensors, its own and rank 0's file
    (per-rank state)."""
    from dist_workers import SHARDED

    by_rank = {r: name for name, r in res["files"].items()}
    want = {0, rank} & set(by_rank)
    for name, (rows, _) in SHARDED.items():
        owner, split = res["hints"][name]
        assert owner is None and split == [0, -(-rows // saved_by)], (name, res["hints"][name])
        mine = -(-rows // loaded_by)
        lo, hi = rank * mine, min(rows, (rank + 1) * mine)
        if lo < hi:
            want |= set(range(lo // split[1], (hi - 1) // split[1] + 1))
    for name, (owner, split) in res["hints"].items():
        if name not in SHARDED:
            assert owner is not None, (name, res["hints"][name])
            want.add(owner)
    return {by_rank[r] for r in want}


@pytest.mark.slow
@pytest.mark.parametrize("saved_by,loaded_by", [(4, 8), (8, 3)])
def test_reshard_load_opens_only_the_shards_it_needs(tmp_path, saved_by, loaded_by):
    """Issue 14 §1: a rank opens only the shards that overlap what it loads (the manifest's
    placement hints), and the reduced reads return bitwise the tensors that were saved."""
    root = str(tmp_path / "root")
    saved = _ok(launch("reads_save", saved_by, {"root": root, "step": 5}, str(tmp_path / "a"), timeout=420))
    res = _ok(launch("reads_load", loaded_by, {"root": root, "path": saved[0]["path"]}, str(tmp_path / "b"), timeout=420))
    for r, got in res.items():
        assert got["step"] == 5 and got["bad"] == [], (r, got)
        assert got["extra"] == ({"rank": r} if r < saved_by else {"rank": 0}), (r, got["extra"])
        expected = _expected_opened(got, r, saved_by, loaded_by)
        assert set(got["opened"]) <= expected, (r, got["opened"], expected)
        assert len(got["opened"]) < saved_by, (r, got["opened"])  # never every shard


@pytest.mark.slow
def test_replicas_that_differ_fail_the_save_naming_tensor_and_ranks(tmp_path):
    """Issue 14 §3: BatchNorm statistics under DDP ``broadcast_buffers=False`` differ per
    rank; ``check_replicas=True`` fails the save on every rank, naming the buffers and the
    ranks, and writes no marker. The default checks parameters and optimizer state only
    (buffers differ between DDP's broadcasts in every BatchNorm job), so it saves."""
    root = str(tmp_path / "root")
    res = launch("replicas_differ", 3, {"root": root, "check": True}, str(tmp_path / "a"), timeout=300)
    for r, got in res.items():
        assert "failed" in got, (r, got)
        msg = got["failed"]
        assert "replicated tensors differ" in msg and "running_mean" in msg and "running_var" in msg, msg
        assert "running_mean' (rank 0 vs rank 1 vs rank 2)" in msg, msg  # three batches: three copies
        assert "weight'" not in msg and "bias'" not in msg, msg  # DDP kept the parameters equal
    assert not os.path.exists(os.path.join(root, step_dir(1), MARKER))
    ok = _ok(launch("replicas_differ", 3, {"root": str(tmp_path / "root2")}, str(tmp_path / "b"), timeout=300))
    assert all("path" in got for got in ok.values())


@pytest.mark.slow
def test_library_retention_across_ranks_reads_only_own_shards(tmp_path):
    """Issue 14 §2: with keep_last, each rank re-reads only the shard it wrote after each
    commit; rank 0 records the verification and prunes without reading any shard of another
    rank. Retention asked for on some ranks only is refused at construction."""
    import json as _json

    root = str(tmp_path / "root")
    res = _ok(launch("retention_ranks", 3, {"root": root}, str(tmp_path / "a"), timeout=420))
    for r, got in res.items():
        assert got["others"] == [], (r, got["others"])
    assert sorted(os.listdir(root)) == [".ckptctl-verified.json", step_dir(3)]
    entry = _json.load(open(os.path.join(root, ".ckptctl-verified.json")))["entries"][step_dir(3)]
    assert entry["level"] == "load" and entry["files"] == 3
    bad = launch("retention_ranks", 2, {"root": str(tmp_path / "r2"), "only_rank0": True}, str(tmp_path / "b"), timeout=300)
    # Refused on every rank at construction, not only where retention was asked for (the rank
    # without it used to go on and wait out its first save for a coordinator that had left).
    assert all("UsageError" in bad[r].get("failed", "") and "keep_last" in bad[r]["failed"] for r in (0, 1)), bad
