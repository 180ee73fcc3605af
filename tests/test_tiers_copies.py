"""Every copy of a step before an older step (issue 31): a node-local first tier with peer
replicas, 2 torchrun "nodes" x 2 ranks (``tier_node_workers.py``), moto S3 behind the fault
proxy.

A rank whose load of step S finds a file damaged sets that copy aside and the job tries S
again, on every rank together: the partner node's replica, then the next tier, and only then
step S-1. An S3 outage during the recovery means the newest step whole on the copies that can
be reached, not an error.
"""

from __future__ import annotations

import os
import shutil

from ckptctl.format.layout import step_dir
from s3_fault_proxy import FaultProxy
from tier_node_workers import Job

REPLICAS = ".ckptctl-replicas"


def _shard(rank: int) -> str:
    return f"rank-{rank:05d}-of-00004.safetensors"


def _flip(path: str, at: int, mask: int) -> None:
    """XOR the byte at ``at`` (from the end when negative) with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_SET if at >= 0 else os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ mask]))


def _flip_a_header_bit(path: str) -> None:
    _flip(path, 40, 0x01)  # in the JSON header every loading rank reads: "version" -> "wersion"


def _flip_a_data_byte(path: str) -> None:
    _flip(path, -5, 0xFF)  # in the last tensor's bytes


def _ok(results: dict[int, dict], job: Job) -> None:
    for r, res in results.items():
        assert "error" not in res and "missing" not in res, f"rank {r}: {res}\n{job.logs()}"


def _resumes(roots: list[str], s3_url: str, out: str, env: dict[str, str], step: int) -> None:
    """A relaunch on ``roots``: every rank resumes ``step``, bitwise what it saved."""
    job = Job("replica_load", [{"local": r, "remote": s3_url, "promote_timeout_s": 3} for r in roots], out, env=env)
    results = job.wait()
    _ok(results, job)
    for k in range(4):
        assert results[k]["step"] == step and results[k]["bitwise_equal"] is True, (k, results[k], job.logs())


def test_a_damaged_copy_is_read_from_the_next_copy_of_the_same_step(tmp_path, s3_server: str, s3_url: str) -> None:
    """Launch 1 saves 10, 20, 30 (node-local KeepLast(2); S3 gets 10 and, at close, 30).

    Launch 2: rank 0's shard of step 30 (whose header every rank reads) is damaged on its own
    node and in its replica on the partner node: every rank resumes step 30 bitwise, that
    file read from S3, not step 20. Launch 3, on the saved roots again: node 0 lost its disk,
    node 1's replicas of node 0's shards of step 30 are damaged, and S3 answers 503 for steps
    20 and 30: every rank resumes step 20, whole on node 1 and its replicas."""
    saved = [str(tmp_path / "saved0"), str(tmp_path / "saved1")]
    proxy = FaultProxy(s3_server).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
    try:
        job = Job("replica_save", [{"local": r, "remote": s3_url, "steps": [10, 20, 30], "promote_timeout_s": 30}
                                   for r in saved], str(tmp_path / "run1"), env=env)
        results = job.wait()
        _ok(results, job)
        assert results[0]["flushed"]["complete"] is True, results[0]

        # --- rank 0's shard (whose header every rank reads) damaged on its node and on the
        # partner's replica: it comes from S3.
        roots = [str(tmp_path / "a0"), str(tmp_path / "a1")]
        for src, dst in zip(saved, roots):
            shutil.copytree(src, dst)
        _flip_a_header_bit(os.path.join(roots[0], step_dir(30), _shard(0)))
        _flip_a_header_bit(os.path.join(roots[1], REPLICAS, step_dir(30), _shard(0)))
        _resumes(roots, s3_url, str(tmp_path / "run2"), env, 30)
        assert os.path.exists(os.path.join(roots[0], step_dir(30), f".{_shard(0)}.damaged"))  # kept for a look

        # --- node 0 lost, node 1's replicas of it damaged, S3 down for 20 and 30: step 20.
        roots = [str(tmp_path / "b0"), str(tmp_path / "b1")]
        shutil.copytree(saved[1], roots[1])
        for k in (0, 1):
            _flip_a_data_byte(os.path.join(roots[1], REPLICAS, step_dir(30), _shard(k)))
        proxy.rule = lambda method, path: "503" if step_dir(20) in path or step_dir(30) in path else None
        _resumes(roots, s3_url, str(tmp_path / "run3"), env, 20)
    finally:
        proxy.stop()
