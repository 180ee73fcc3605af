"""Tiered checkpointing (first slice): a local first tier and a moto S3 tier over HTTP.

Saves commit to the local tier; a background promoter copies them to S3 (verified on the way,
marker last); each tier prunes by its own rules and never deletes what awaits promotion; an S3
outage (a fault proxy answering 503) never stops local saves, and promotion catches up after
it; ``close`` waits a bounded time; ``load_latest`` falls back to S3 for a lost local tier.
Multi-rank runs use real gloo processes (``tier_workers.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Iterator

import pytest
import torch

from ckptctl import Checkpointer, KeepLast, Minutes, Steps, Tier
from ckptctl.format.layout import step_dir
from ckptctl.layouts.native_read import read_committed
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy
from tier_workers import launch, state_for


def _steps(root: str) -> set[int]:
    """Steps committed under a local root (a marker is what makes one)."""
    if not os.path.isdir(root):
        return set()
    return {int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")
            and os.path.exists(os.path.join(root, n, "COMMITTED"))}


def _s3_steps(url: str) -> set[int]:
    root = open_storage(url)
    return {int(i.key.split("-")[1]) for i in root.children() if i.key.startswith("step-")
            and root.sub(i.key).stat("COMMITTED") is not None}


class Records(logging.Handler):
    """The "ckptctl" logger's records (pytest's capture is off under ``-p no:logging``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))

    def count(self, text: str, level: int = logging.WARNING) -> int:
        return sum(1 for lvl, msg in list(self.lines) if lvl >= level and text in msg)


@pytest.fixture
def records() -> Iterator[Records]:
    handler, logger = Records(), logging.getLogger("ckptctl")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


@pytest.fixture
def proxy(s3_server: str, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of moto; the test's S3 tier talks through it, the checks don't."""
    p = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # an outage is seen in one short retry, not ten
    try:
        yield p
    finally:
        p.stop()


def _until(predicate, what: str, limit_s: float = 60.0) -> None:
    """Poll a background outcome (a bound against hanging, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def _state(step: int) -> dict:
    return state_for(step, 0)


def test_cadence_composes_with_or() -> None:
    every = Steps(1000) | Minutes(30)
    assert every.due(1000, 0.0, None, None)  # the first one is always due
    assert not every.due(1500, 60.0, 1000, 0.0)
    assert every.due(2000, 60.0, 1000, 0.0)  # 1000 steps
    assert every.due(1100, 1800.0, 1000, 0.0)  # 30 minutes
    with pytest.raises(ValueError, match="first tier receives every save"):
        Checkpointer(tiers=[Tier("/tmp/x", every=Steps(2))])
    with pytest.raises(ValueError, match="either root"):
        Checkpointer("/tmp/x", tiers=[Tier("/tmp/y")])


def test_saves_commit_locally_promote_to_s3_each_tier_keeps_its_own(tmp_path, s3_url) -> None:
    local = str(tmp_path / "nvme")
    with Checkpointer(tiers=[Tier(local, retention=KeepLast(2)), Tier(s3_url, retention=KeepLast(3))]) as ck:
        for step in range(1, 7):
            assert ck.save(step, _state(step)).wait() == os.path.join(local, step_dir(step))
        flushed = ck.close()
    assert flushed and flushed.step == 6 and flushed.tiers == (local, s3_url)
    assert set(flushed.durable_s) == {local, s3_url}  # time to durable on each tier
    assert cli("verify", f"{s3_url}/{step_dir(6)}").exit_code == 0
    # The last tier keeps its newest 3 of what reached it (a promoter behind skips some);
    # the first keeps its newest 2, plus at most one that awaited promotion at its last prune.
    remote = _s3_steps(s3_url)
    assert 6 in remote and len(remote) <= 3, remote
    assert {5, 6} <= _steps(local) and len(_steps(local)) <= 3, _steps(local)

    # The first tier's copy of step 6 is corrupt: step 6 comes from S3, not step 5 from disk.
    m, _ = read_committed(open_storage(os.path.join(local, step_dir(6))))
    shard = os.path.join(local, step_dir(6), m.files[0].name)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    state = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "extra": {}}
    ck = Checkpointer(tiers=[Tier(local), Tier(s3_url)])
    assert ck.load_latest(state, prepare=False) == 6
    assert torch.equal(state["model"]["w"], _state(6)["model"]["w"])

    # The whole first tier is lost (a replaced node): the newest step comes back from S3.
    shutil.rmtree(local)
    state = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "extra": {}}
    assert ck.load_latest(state, prepare=False) == 6
    assert all(torch.equal(state["model"][k], _state(6)["model"][k]) for k in ("w", "b"))
    ck.close()


def test_s3_outage_saves_go_on_pins_hold_promotion_catches_up(tmp_path, s3_url, proxy, records) -> None:
    local = str(tmp_path / "nvme")
    remote = Tier(s3_url, retention=KeepLast(3), every=Minutes(60), retry_max_s=0.2, lag_warning_s=0.5,
                  storage=open_storage(s3_url, endpoint_url=proxy.url))
    ck = Checkpointer(tiers=[Tier(local, retention=KeepLast(1)), remote], promote_timeout_s=60)
    proxy.rule = lambda method, path: "503"  # S3 is down from the start
    for step in (1, 2, 3, 4):  # local saves go on
        assert ck.save(step, _state(step)).wait() == os.path.join(local, step_dir(step))
    # Step 1 was chosen (the first is always due; 2..4 are not, by the 60-minute cadence) and
    # is still awaiting promotion: KeepLast(1) alone would have deleted it.
    _until(lambda: records.count("lags by") == 1, "the lag warning")
    seen = len(proxy.injected)
    _until(lambda: len(proxy.injected) >= seen + 4, "more failed attempts")
    assert records.count("lags by") == 1  # warned once, not at every retry
    assert 1 in _steps(local)
    assert _s3_steps(s3_url) == set()

    proxy.rule = lambda method, path: None  # S3 is back
    _until(lambda: s3_url in ck.time_to_durable(1), "step 1 promoted after the outage")
    assert ck.save(5, _state(5)).wait()
    flushed = ck.close()  # the final checkpoint is promoted whatever the cadence says
    assert flushed and flushed.step == 5
    assert records.count("caught up") == 1
    assert _s3_steps(s3_url) == {1, 5}  # 2..4 were never due
    assert _steps(local) == {5}  # step 1 promoted, so no longer pinned: the prune after 5 took it
    assert cli("verify", s3_url, "--all").exit_code == 0


def test_steps_cadence_chooses_the_multiples_of_n() -> None:
    """``Steps(10)`` reads as "every 10 steps": with a save every 5 steps it chooses 10, 20,
    30 after the run's first save, not 15, 25, 35; with saves every 15, the first save at or
    past each multiple."""
    def chosen(steps: list[int], every: Steps) -> list[int]:
        out: list[int] = []
        for step in steps:
            if every.due(step, 0.0, out[-1] if out else None, 0.0 if out else None):
                out.append(step)
        return out

    assert chosen(list(range(5, 40, 5)), Steps(10)) == [5, 10, 20, 30]
    assert chosen(list(range(10, 45, 5)), Steps(10)) == [10, 20, 30, 40]
    assert chosen(list(range(15, 91, 15)), Steps(10)) == [15, 30, 45, 60, 75, 90]
    assert chosen(list(range(1, 8)), Steps(1)) == list(range(1, 8))


def test_time_to_durable_reports_every_tier_reached(tmp_path) -> None:
    """The newest save is on the first tier only when the next tier's cadence did not choose
    it; ``time_to_durable()`` still reports the next tier, from the newest step that reached it."""
    first, second = str(tmp_path / "nvme"), str(tmp_path / "shared")
    ck = Checkpointer(tiers=[Tier(first), Tier(second, every=Steps(10))])
    try:
        ck.save(10, _state(10)).wait()
        _until(lambda: second in ck.time_to_durable(10), "step 10 promoted")
        ck.save(11, _state(11)).wait()  # not due on the second tier
        assert set(ck.time_to_durable(11)) == {first}
        durable = ck.time_to_durable()
        assert set(durable) == {first, second}
        assert durable[second] == ck.time_to_durable(10)[second] and durable[first] == ck.time_to_durable(11)[first]
    finally:
        ck.close(promote_timeout_s=30)


def test_close_waits_a_bounded_time_and_says_so(tmp_path, s3_url, proxy, records) -> None:
    local = str(tmp_path / "nvme")
    proxy.rule = lambda method, path: "503"
    remote = Tier(s3_url, retry_max_s=0.2, storage=open_storage(s3_url, endpoint_url=proxy.url))
    ck = Checkpointer(tiers=[Tier(local), remote])
    ck.save(1, _state(1)).wait()
    flushed = ck.close(promote_timeout_s=1.0)
    assert flushed is not None and not flushed and flushed.step == 1
    assert flushed.missing == s3_url and flushed.tiers == (local,)
    assert records.count(f"did not reach {s3_url}") == 1
    assert _s3_steps(s3_url) == set() and _steps(local) == {1}


def test_two_ranks_promote_to_s3_and_recover_from_it(tmp_path, s3_url) -> None:
    local = str(tmp_path / "shared")
    args = {"local": local, "remote": s3_url, "steps": [1, 2, 3, 4]}
    saved = launch("save_tiers", 2, args, str(tmp_path / "a"))
    for r, res in saved.items():
        assert "error" not in res and "exit" not in res, (r, res)
    assert saved[0]["flushed"] == {"complete": True, "step": 4, "tiers": [local, s3_url]}
    assert saved[1]["flushed"] is None  # rank 0 promotes
    assert set(saved[0]["durable"]) == {local, s3_url}
    assert cli("verify", f"{s3_url}/{step_dir(4)}").exit_code == 0
    assert {3, 4} <= _steps(local) and 4 in _s3_steps(s3_url) and len(_s3_steps(s3_url)) <= 2

    shutil.rmtree(local)  # the shared first tier is gone: both ranks resume from S3
    loaded = launch("load_tiers", 2, args, str(tmp_path / "b"))
    for r, res in loaded.items():
        assert res.get("step") == 4 and res["bitwise_equal"], (r, res)
        assert res["extra"] == {"rank": r, "step": 4}  # each rank's own state, from S3


def test_ls_with_tiers_shows_where_each_checkpoint_lives(tmp_path, s3_url) -> None:
    local = str(tmp_path / "nvme")
    with Checkpointer(tiers=[Tier(local, retention=KeepLast(1)), Tier(s3_url)]) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step)).wait()
        assert ck.close()
    os.makedirs(os.path.join(local, step_dir(4)))  # a save in progress on the first tier only
    r = cli("ls", local, "--tier", s3_url, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["tiers"] == [local, s3_url]
    where = {c["step"]: c["tiers"] for c in doc["checkpoints"]}
    assert where[3] == {local: "committed", s3_url: "committed"}  # promoted, kept on both
    assert where[4] == {local: "partial", s3_url: None}  # not on S3 (yet)
    # Each column is that tier's own truth: NVMe pruned to its newest (and what awaited
    # promotion), S3 keeps everything that reached it.
    assert {s for s in where if where[s][local] == "committed"} == _steps(local)
    assert {s for s in where if where[s][s3_url] == "committed"} == _s3_steps(s3_url)
    assert len(_steps(local)) < 3 and 3 in _s3_steps(s3_url)  # NVMe pruned; S3 holds the newest
    text = cli("ls", local, "--tier", s3_url)
    assert text.exit_code == 0 and "TIER 1" in text.stdout and f"tier 1: {s3_url}" in text.stderr
    assert cli("ls", local, "--tier", local).exit_code == 2  # a tier named twice
    spelled = cli("ls", local, "--tiers", s3_url, "--json")  # the spelling issue 23 uses
    assert spelled.exit_code == 0 and spelled.json()["checkpoints"] == doc["checkpoints"], spelled.stderr
