"""A first tier that heals, and tiers that leave nothing behind (issue 31).

* A full first tier frees itself as soon as promotion catches up: its retention runs again
  whenever a pin is released (a real 30 MiB tmpfs, 12 MiB states, ``KeepLast(1)``: 7 saves of
  7 commit, and after ``close`` only the newest is left).
* A promotion that finishes after ``close`` (left on its daemon thread) reports nothing false.
* A constructor that fails on every rank (retention set on one rank only) leaves no tier
  thread running, and the next ``Checkpointer`` works.
* A step committed on one node's disk only (its other part lost) is refused on every rank at
  once, and the job's next save commits.
* A node-local tier alone on several nodes, with no replicas, warns that a lost node loses
  every step.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import torch

from ckptctl import Checkpointer, KeepLast, Tier
from ckptctl.format.layout import step_dir
from ckptctl.storage import open_storage
from helpers import tmpfs
from test_tiers import _s3_steps, _steps, _until, proxy, records  # noqa: F401  (fixtures)
from tier_workers import launch


def _big(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(3 << 20, generator=g)}, "extra": {"step": step}}  # 12 MiB


def test_a_full_first_tier_frees_itself_when_promotion_catches_up(s3_url, proxy) -> None:
    """Two 12 MiB checkpoints fill the 30 MiB first tier. Each promotion is slow (every S3
    request stalls 0.3 s), so the prune after save k+1 must keep k (pinned: being copied);
    once k reached S3, that pin is released and the first tier's retention runs again, so
    save k+2 finds room. Before, nothing ran it again: every save after the second failed."""
    proxy.rule = lambda method, path: "stall:0.3" if method in ("PUT", "POST") else None
    remote = Tier(s3_url, storage=open_storage(s3_url, endpoint_url=proxy.url))
    with tmpfs("30m") as nvme:
        ck = Checkpointer(tiers=[Tier(nvme, retention=KeepLast(1)), remote], promote_timeout_s=120)
        committed = []
        for step in range(1, 8):
            ck.save(step, _big(step)).wait()
            committed.append(step)
            # The job's pace: the next save once the one before reached S3 and its first-tier
            # copy was let go (it is no longer pinned).
            _until(lambda: s3_url in ck.time_to_durable(step - 1) or step == 1, f"step {step - 1} promoted")
            _until(lambda: _steps(nvme) == {step}, f"the first tier let step {step - 1} go", 60)
        flushed = ck.close()
        assert committed == list(range(1, 8))
        assert flushed and flushed.step == 7
        assert _steps(nvme) == {7}  # KeepLast(1) once the last pin is gone, not [6, 7]
    assert 7 in _s3_steps(s3_url)


def test_a_promotion_that_ends_after_close_reports_nothing_false(tmp_path, s3_url, proxy, records) -> None:
    """Step 1 reaches S3 (its retention runs there); step 2's marker upload hangs past
    ``close``, which leaves the promoter on its thread and shuts the tiers' retention down. When
    the upload ends, the promotion completes, and nothing is run on a closed pool: before, that
    raised in the promoter and logged a false "promotion failed unexpectedly"."""
    local = str(tmp_path / "nvme")
    marker2 = f"/{step_dir(2)}/COMMITTED"
    proxy.rule = lambda method, path: "hold" if method == "PUT" and path.split("?")[0].endswith(marker2) else None
    remote = Tier(s3_url, retention=KeepLast(1), storage=open_storage(s3_url, endpoint_url=proxy.url))
    ck = Checkpointer(tiers=[Tier(local, retention=KeepLast(1)), remote])
    ck.save(1, _big(1)).wait()
    _until(lambda: s3_url in ck.time_to_durable(1), "step 1 promoted")
    ck.save(2, _big(2)).wait()
    _until(lambda: proxy.injected, "step 2's marker upload")
    flushed = ck.close(promote_timeout_s=0.1)  # the promoter is left on its thread after 5 s
    assert flushed is not None and not flushed
    proxy.release.set()
    _until(lambda: 2 in _s3_steps(s3_url), "the late promotion")
    _until(lambda: not [t for t in threading.enumerate() if t.name.startswith("ckptctl-promote")], "the promoter's end")
    assert records.count("unexpectedly", logging.ERROR) == 0 and records.count("not promoting", logging.ERROR) == 0, \
        records.lines


def test_a_constructor_that_fails_on_every_rank_leaves_no_tier_thread(tmp_path, s3_url) -> None:
    args = {"local": str(tmp_path / "shared"), "remote": s3_url}
    results = launch("build_fails", 2, args, str(tmp_path / "out"))
    for r, res in results.items():
        assert "error" not in res and "exit" not in res, (r, res)
        assert res["raised"] and "retention" in res["raised"], (r, res)
        assert res["threads_left"] == [], (r, res)
    assert results[0]["flushed"] is True


def test_a_step_committed_on_one_node_only_is_refused_on_every_rank(tmp_path) -> None:
    """Two ranks, each its own node. Step 2 commits on both; node 1 then loses its copy, as a
    node that lost its disk before its part was anywhere else. save(2) again must fail on both
    ranks (node 0 holds it committed: never overwritten), and save(3) must commit: before,
    rank 0 refused alone, rank 1 waited for it in the save's round, and the ranks fell out of
    step for good."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    first = launch("node_saves", 2, {"roots": roots, "steps": [1, 2]}, str(tmp_path / "a"))
    assert all(r.get("outcomes") == ["ok", "ok"] for r in first.values()), first
    shutil.rmtree(os.path.join(roots[1], step_dir(2)))
    again = launch("node_saves", 2, {"roots": roots, "steps": [2, 3], "timeout_s": 20}, str(tmp_path / "b"))
    for r, res in again.items():
        assert "outcomes" in res, (r, res)
        refused, next_one = res["outcomes"]
        assert next_one == "ok", (r, res)
        assert "already committed" in refused, (r, res)


def test_a_node_local_tier_alone_on_several_nodes_warns_that_a_lost_node_loses_every_step(tmp_path) -> None:
    """With no replicas and no later tier each file of a step is on one node's disk only: a
    relaunch resumes (each node fetches what its ranks read from the others:
    ``test_tiers_fetch.py``), but a node that loses its disk takes every step with it. Rank 0
    says so once, when the Checkpointer is made; not when a later tier holds every shard."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    alone = launch("node_saves", 2, {"roots": roots, "steps": [1]}, str(tmp_path / "a"))
    assert all(r.get("outcomes") == ["ok"] for r in alone.values()), alone
    said = [w for w in alone[0]["warnings"] if "loses every step" in w]
    assert len(said) == 1 and "add replicas=1" in said[0] and "cannot resume" not in said[0], alone[0]["warnings"]
    assert not [w for w in alone[1]["warnings"] if "loses every step" in w]  # rank 0 alone says it
    roots = [str(tmp_path / "node0b"), str(tmp_path / "node1b")]
    later = launch("node_saves", 2, {"roots": roots, "steps": [1], "next": str(tmp_path / "shared")}, str(tmp_path / "b"))
    assert all(r.get("outcomes") == ["ok"] for r in later.values()), later
    assert not [w for r in later.values() for w in r["warnings"] if "no later tier" in w]
