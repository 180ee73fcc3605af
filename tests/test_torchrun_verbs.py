"""``verify``, ``cp`` and ``restore`` run by torchrun (issue 23): each rank takes its share of the
files, rank 0 prints the job's result, and every rank exits with the same status.

Real torchrun processes running the real command line (``torchrun_verbs_workers.py``), real
gloo groups, moto's S3 over HTTP through a counting proxy per node: a restore on two "nodes"
fetches to each node only the shards its ranks read, and a node-local tier relaunched on those
copies resumes bitwise. (Each launch costs seconds of torch start-up on 2 cores: the one-node
checks share one launch.)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MANIFEST, MARKER, shard_name, step_dir
from ckptctl.format.shard import HEADER_GUESS
from ckptctl.errors import UsageError
from ckptctl.ops.distributed import Job as RankJob, share
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy
from test_reshard import assert_bitwise, tensors_of
from tier_node_workers import Job
from tier_workers import launch as launch_ranks
from torchrun_verbs_workers import launch, logs


class CountingProxy(FaultProxy):
    """The fault proxy, also counting the body bytes it returned to each GET, by object name."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.fetched: dict[str, int] = defaultdict(int)
        self._count_lock = threading.Lock()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        real, name, proxy = h.wfile, urlsplit(h.path).path.rsplit("/", 1)[-1], self

        class Counted:
            def write(self, data: bytes) -> int:
                if h.command == "GET" and not bytes(data[:9]) == b"HTTP/1.1 ":  # the body, not the status and headers
                    with proxy._count_lock:
                        proxy.fetched[name] += len(data)
                return real.write(data)

            def flush(self) -> None:
                real.flush()

        h.wfile = Counted()  # type: ignore[assignment]
        try:
            super()._serve(h)
        finally:
            h.wfile = real


def _files(path: str) -> set[str]:
    return {n for n in os.listdir(path)}


def test_restore_on_two_nodes_fetches_each_node_only_its_shards_and_a_node_local_tier_resumes(
        tmp_path, s3_server: str, s3_url: str) -> None:
    # 4 real ranks save step 10 (state_for: replicated weights, per-rank extra), promoted to S3.
    saved = launch_ranks("save_tiers", 4, {"local": str(tmp_path / "shared"), "remote": s3_url, "steps": [10]},
                         str(tmp_path / "save"))
    assert all("flushed" in saved[r] for r in range(4)), saved
    src = open_storage(s3_url).sub(step_dir(10))
    sizes = {i.key: i.size for i in src.list()}
    shards = [shard_name(r, 4) for r in range(4)]
    assert set(shards) <= set(sizes), sizes

    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    proxies = [CountingProxy(s3_server).start() for _ in roots]
    try:
        ran = launch(str(tmp_path / "restore"), [[["restore", s3_url, root, "--json"]] for root in roots],
                     env=[{"AWS_ENDPOINT_URL": p.url} for p in proxies])
        fetched = [dict(p.fetched) for p in proxies]
    finally:
        for p in proxies:
            p.stop()
    assert all(len(ran[r]) == 1 and ran[r][0].exit == 0 for r in range(4)), (ran, logs(str(tmp_path / "restore"), 2))
    assert all(ran[r][0].stdout == "" for r in (1, 2, 3)), ran  # rank 0 speaks for the job
    doc = json.loads(ran[0][0].stdout)
    assert doc["step"] == 10 and doc["url"] == os.path.join(roots[0], step_dir(10))
    assert [(n["node"], n["ranks"], n["files"]) for n in doc["copy"]["ranks"]] == [("node-0", [0, 1], 2), ("node-1", [2, 3], 2)]
    for node, root in enumerate(roots):
        mine, others = shards[2 * node: 2 * node + 2], shards[:2 * node] + shards[2 * node + 2:]
        # Each node's disk: only its ranks' shards, plus the manifest and marker.
        assert _files(os.path.join(root, step_dir(10))) == {*mine, MANIFEST, MARKER}
        # What it fetched from S3: its shards, each read once after its header was checked (one
        # GET of up to HEADER_GUESS bytes, or the header's length and then the header: these
        # small shards are mostly header), and the manifest, marker and listings; never a byte
        # of another node's shards.
        got = fetched[node]
        print(f"node {node}: fetched {sum(got.values())} bytes from S3 "
              f"({', '.join(f'{k} {v}' for k, v in sorted(got.items()))}); its shards are {sum(sizes[s] for s in mine)} bytes, "
              f"the checkpoint {sum(sizes.values())}")
        assert not any(got.get(s) for s in others), got
        for s in mine:
            with open(os.path.join(root, step_dir(10), s), "rb") as f:
                header = 8 + int.from_bytes(f.read(8), "little")
            assert sizes[s] <= got[s] <= sizes[s] + max(8 + header, min(HEADER_GUESS, sizes[s])), (s, got, sizes)
        assert sum(v for k, v in got.items() if k not in mine) <= 64 * 1024, got  # metadata and listings
    # Relaunched with a node-local first tier on those disks: every rank resumes step 10, bitwise.
    job = Job("load", [{"local": r, "remote": s3_url} for r in roots], str(tmp_path / "load"),
              env={"AWS_ENDPOINT_URL": s3_server})
    loaded = job.wait()
    assert all(loaded[r].get("step") == 10 and loaded[r].get("bitwise_equal") is True for r in range(4)), (loaded, job.logs())


def test_restore_resharding_on_two_nodes_writes_each_rank_its_own_target_shard(tmp_path, s3_server: str, s3_url: str) -> None:
    """Saved by 1 rank, restored for 4 on 2 nodes x 2: each rank re-shards its own target shard
    from S3 into its node's disk; the two nodes' copies together are the checkpoint, bitwise."""
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(128 * (i + 1), 64) for i in range(4)}, "extra": {"epoch": 3}}
    with Checkpointer(str(tmp_path / "one")) as ck:
        local = ck.save(7, state).wait()
    assert cli("cp", local, s3_url).exit_code == 0
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    proxies = [CountingProxy(s3_server).start() for _ in roots]
    try:
        ran = launch(str(tmp_path / "restore"), [[["restore", s3_url, root, "--world-size", "4"]] for root in roots],
                     env=[{"AWS_ENDPOINT_URL": p.url} for p in proxies])
        fetched = [sum(p.fetched.values()) for p in proxies]
    finally:
        for p in proxies:
            p.stop()
    assert all(ran[r][0].exit == 0 for r in range(4)), (ran, logs(str(tmp_path / "restore"), 2))
    assert ran[0][0].stdout.strip() == os.path.join(roots[0], step_dir(7)) and not any(ran[r][0].stdout for r in (1, 2, 3))
    merged = tmp_path / "merged" / step_dir(7)
    merged.mkdir(parents=True)
    total = 0
    for node, root in enumerate(roots):
        d = os.path.join(root, step_dir(7))
        mine = {shard_name(2 * node, 4), shard_name(2 * node + 1, 4)}
        assert _files(d) == {*mine, MANIFEST, MARKER}
        for n in _files(d):
            shutil.copy(os.path.join(d, n), merged / n)
        node_bytes = sum(os.path.getsize(os.path.join(d, n)) for n in mine)
        total += node_bytes
        print(f"node {node}: fetched {fetched[node]} bytes from S3 for {node_bytes} bytes of target shards")
        # Two passes over the source chunks it needs (hash, then write), the headers, the manifest.
        assert fetched[node] <= 2 * node_bytes + 256 * 1024
    r = cli("verify", str(merged), "--json")
    assert r.exit_code == 0 and r.json()["checkpoints"][0]["files"] == 4, r.stdout
    assert_bitwise(tensors_of(local), tensors_of(str(merged)))


def test_verify_and_cp_split_over_ranks_and_agree_on_failure(tmp_path, s3_server: str, s3_url: str) -> None:
    """One node, 2 ranks: verify reads each rank's share (by bytes, per rank in --json); cp's
    copy verifies; a flipped bit fails verify on every rank naming the file; a rank whose
    uploads fail makes every rank exit 3 and leaves no marker."""
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(128 * (i + 1), 64) for i in range(6)}, "extra": {}}
    with Checkpointer(str(tmp_path / "one")) as ck:
        one = ck.save(5, state).wait()
    good = str(tmp_path / "root" / step_dir(5))
    assert cli("reshard", one, good, "--world-size", "4").exit_code == 0
    bad = str(tmp_path / "bad" / step_dir(5))
    shutil.copytree(good, bad)
    flipped = shard_name(2, 4)
    with open(os.path.join(bad, flipped), "r+b") as f:
        f.seek(os.path.getsize(f.name) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    copy = str(tmp_path / "copy")
    sizes = [os.path.getsize(os.path.join(good, shard_name(r, 4))) for r in range(4)]
    split = share(sizes, 2)  # the files each rank takes, balanced by bytes
    proxy = FaultProxy(s3_server).start()
    # The uploads of one of rank 1's files fail (rank 0's succeed).
    failing = shard_name(split[1][0], 4)
    proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and failing in path else None
    try:
        ran = launch(str(tmp_path / "run"), [[
            ["verify", good, "--json"],
            ["cp", good, copy, "--json"],
            ["verify", bad],
            ["cp", good, s3_url],
        ]], env=[{"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}])
    finally:
        proxy.stop()
    assert all(len(ran[r]) == 4 for r in (0, 1)), (ran, logs(str(tmp_path / "run"), 1))
    assert [[x.exit for x in ran[r]] for r in (0, 1)] == [[0, 0, 1, 3]] * 2, ran
    assert all(x.stdout == "" for x in ran[1]), ran[1]  # rank 0 speaks for the job
    assert all(x.stderr == "" for x in ran[1]), ran[1]

    # verify: each rank read exactly its share of the files, balanced by bytes.
    assert sorted(split[0] + split[1]) == [0, 1, 2, 3] and len(split[0]) == len(split[1]) == 2
    doc = json.loads(ran[0][0].stdout)
    report = doc["checkpoints"][0]
    assert doc["ok"] is True and report["bytes_read"] == sum(sizes)
    assert [(s["rank"], s["files"], s["bytes_read"]) for s in report["ranks"]] == \
        [(k, len(split[k]), sum(sizes[i] for i in split[k])) for k in (0, 1)], report["ranks"]

    # cp: a checkpoint verify accepts, each rank having copied its share.
    doc = json.loads(ran[0][1].stdout)
    assert [s["files"] for s in doc["ranks"]] == [2, 2] and doc["bytes"] == sum(sizes)
    r = cli("verify", os.path.join(copy, step_dir(5)))
    assert r.exit_code == 0, r.stdout + r.stderr
    assert_bitwise(tensors_of(good), tensors_of(os.path.join(copy, step_dir(5))))

    # A flipped bit: exit 1 on every rank, the file named by rank 0.
    assert f"{flipped}, tensor" in ran[0][2].stdout and "FAILED" in ran[0][2].stdout

    # A rank failing mid-copy: exit 3 everywhere, one message naming the rank, no marker.
    assert "rank 1:" in ran[0][3].stderr and "storage error" in ran[0][3].stderr and failing in ran[0][3].stderr, \
        ran[0][3].stderr
    dst = open_storage(s3_url).sub(step_dir(5))
    assert dst.stat(MARKER) is None and dst.stat(MANIFEST) is None


def test_the_split_is_deterministic_balanced_by_bytes_and_nodes_get_their_ranks_shards() -> None:
    assert share([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]  # largest first, each to the lightest rank
    assert share([5, 5, 5, 5], 2) == [[0, 2], [1, 3]] and share([], 3) == [[], [], []]
    job = RankJob(2, ("node-0", "node-0", "node-1", "node-1"))
    assert job.node_ranks == (2, 3) and job.leader and not RankJob(3, job.nodes).leader
    assert job.node_targets(4) == [2, 3]  # a job of the loading job's size: the node's own ranks
    assert job.node_targets(8) == [4, 5, 6, 7]  # else an equal block per node, in node order
    with pytest.raises(UsageError, match="does not split evenly over the 2 nodes"):
        job.node_targets(3)


# --- ranks that disagree or are gone (issue 29, item 2) ----------------------------------------

def _two_checkpoints(tmp_path) -> tuple[str, str, str]:
    """(a checkpoint of 4 shards under ROOT, ROOT, another checkpoint)."""
    torch.manual_seed(0)
    with Checkpointer(str(tmp_path / "one")) as ck:
        one = ck.save(5, {"model": {f"w{i}": torch.randn(64 * (i + 1), 32) for i in range(4)}, "extra": {}}).wait()
        other = ck.save(6, {"model": {"w": torch.randn(8, 8)}, "extra": {}}).wait()
    good = str(tmp_path / "root" / step_dir(5))
    assert cli("reshard", one, good, "--world-size", "4").exit_code == 0
    return good, str(tmp_path / "root"), other


def test_ranks_given_different_commands_stop_before_any_work_and_a_rank_that_never_starts_is_named(tmp_path) -> None:
    """One node, 2 ranks, each given its own command line. Before: `cp SRC D0` | `cp SRC D1`
    both exited 0 (a committed copy that failed verify), `verify A` | `verify A --quick` said
    "ok (checksums)" for a rank that read nothing, and `verify A` | `ls ROOT` (or `cp A D`,
    `cp B D'`) hung until killed. Now every rank exits 2 naming both commands and what differs,
    having written nothing; and a rank that never starts the command is named (exit 3)."""
    a, root, b = _two_checkpoints(tmp_path)
    out = {name: str(tmp_path / name) for name in ("D", "D2", "D0", "D1", "N0", "N1")}
    pairs = [
        (["verify", a], ["ls", root], "verb"),
        (["verify", a], ["cp", a, out["D"]], "verb"),
        (["cp", b, out["D2"]], ["verify", a], "verb"),
        (["verify", a], ["verify", a, "--quick"], "quick"),
        (["cp", a, out["D0"]], ["cp", a, out["D1"]], "dst"),
        (["restore", root, out["N0"]], ["restore", root, out["N1"]], "dst"),
    ]
    commands = [{"0": r0, "1": r1} for r0, r1, _ in pairs]
    commands += [["verify", a, "--json"], {"0": ["verify", a], "1": ["--version"]}]
    ran = launch(str(tmp_path / "run"), [commands], env=[{"CKPTCTL_TORCHRUN_TIMEOUT": "20"}])
    assert all(len(ran[r]) == len(commands) for r in (0, 1)), (ran, logs(str(tmp_path / "run"), 1))
    for i, (r0, r1, differs) in enumerate(pairs):
        assert [ran[r][i].exit for r in (0, 1)] == [2, 2], (i, ran[0][i], ran[1][i])
        text = ran[0][i].stderr
        assert "were given different commands" in text and f"({differs} differ" in text, (i, text)
        assert f"rank 0: {r0[0]}" in text and f"rank 1: {r1[0]}" in text, (i, text)
    assert "on node-0" in ran[0][5].stderr  # restore's DST may differ between nodes, never within one
    assert not any(os.path.exists(p) for p in out.values()), [p for p in out.values() if os.path.exists(p)]
    # The ranks still agree on the next command, in the same group: it runs.
    assert [ran[r][len(pairs)].exit for r in (0, 1)] == [0, 0] and json.loads(ran[0][len(pairs)].stdout)["ok"] is True
    last = [ran[r][-1] for r in (0, 1)]
    assert last[1].exit == 0 and last[0].exit == 3, last
    assert "rank(s) 1 of this torchrun job did not start `ckptctl verify` within 20s" in last[0].stderr, last[0].stderr


def test_a_rank_that_stops_answering_is_named_within_the_timeout(tmp_path, s3_server: str, s3_url: str) -> None:
    """Rank 1 is stopped (SIGSTOP: a hung or cut-off host, which torchrun does not notice) while
    it reads its share: rank 0, done with its own, is told which rank is gone within
    CKPTCTL_TORCHRUN_TIMEOUT instead of waiting for ever, and exits 3 naming it."""
    import signal
    import time

    a, _root, _b = _two_checkpoints(tmp_path)
    assert cli("cp", a, s3_url).exit_code == 0
    sizes = [os.path.getsize(os.path.join(a, shard_name(r, 4))) for r in range(4)]
    theirs = {shard_name(i, 4) for i in share(sizes, 2)[1]}  # the files rank 1 reads
    run = str(tmp_path / "run")
    stopped: list[int] = []

    def stop_rank1(method: str, path: str) -> None:
        if method == "GET" and path.split("?")[0].rsplit("/", 1)[-1] in theirs and not stopped:
            pid = int(open(os.path.join(run, "rank1.pid")).read())
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            threading.Thread(target=release, args=(pid,), daemon=True).start()
        return None

    def release(pid: int) -> None:  # once rank 0 has answered, rank 1 is put out of its misery
        deadline = time.monotonic() + 110
        while not os.path.exists(os.path.join(run, "rank0.0.exit")) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)

    proxy = FaultProxy(s3_server).start()
    proxy.rule = stop_rank1  # type: ignore[assignment]
    try:
        ran = launch(run, [[["verify", f"{s3_url}/{step_dir(5)}"]]],
                     env=[{"AWS_ENDPOINT_URL": proxy.url, "CKPTCTL_TORCHRUN_TIMEOUT": "20"}])
    finally:
        proxy.stop()
    assert stopped, logs(run, 1)
    assert len(ran[0]) == 1 and ran[0][0].exit == 3, (ran, logs(run, 1))
    assert "rank(s) 1 of this torchrun job stopped answering (no sign of life for 20s)" in ran[0][0].stderr, \
        ran[0][0].stderr


def test_restore_under_torchrun_skips_a_corrupt_newest_on_every_rank_together(tmp_path) -> None:
    """2 ranks: the newest checkpoint of the root has a flipped bit in one shard, so the rank
    copying that shard finds it corrupt; every rank passes it over together (rank 0 names the
    candidates) and the job restores the one before, naming the skipped one; pinned to the
    corrupt step, every rank exits 1 and nothing is committed at the destination."""
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(64 * (i + 1), 32) for i in range(4)}, "extra": {}}
    with Checkpointer(str(tmp_path / "one")) as ck:
        five = ck.save(5, state).wait()
        six = ck.save(6, state).wait()
    root = tmp_path / "root"
    for one in (five, six):
        assert cli("reshard", one, str(root / os.path.basename(one)), "--world-size", "4").exit_code == 0
    flipped = root / step_dir(6) / shard_name(3, 4)
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    dst, pinned = str(tmp_path / "dst"), str(tmp_path / "pinned")
    ran = launch(str(tmp_path / "run"), [[["restore", str(root), dst, "--json"],
                                          ["restore", str(root), pinned, "--step", "6"]]])
    assert all(len(ran[r]) == 2 for r in (0, 1)), (ran, logs(str(tmp_path / "run"), 1))
    assert [[x.exit for x in ran[r]] for r in (0, 1)] == [[0, 1]] * 2, ran
    doc = json.loads(ran[0][0].stdout)
    assert doc["step"] == 5 and [(s["step"], shard_name(3, 4) in s["reason"]) for s in doc["skipped"]] == [(6, True)], doc
    assert cli("verify", os.path.join(dst, step_dir(5))).exit_code == 0
    assert not os.path.exists(os.path.join(dst, step_dir(6), MARKER))
    assert not os.path.exists(os.path.join(pinned, step_dir(6), MARKER))
