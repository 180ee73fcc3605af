"""``ckptctl.integrations.dcp``: DCP's own save, async save and load on 2 real gloo ranks through
the sealing Writer and the checking Reader, then ckptctl's verbs on what they wrote; the same on
``s3://`` (moto over HTTP) in one process.

One launch of the job (``integration_dcp_worker``) covers: step-1 ``dcp.save``, step-2
``dcp.async_save``, a load of step-2 that round-trips; a bit flipped in rank 1's data file of
step-2, which ``verify`` names and the Reader refuses on both ranks before any tensor changes;
and step-3 killed (SIGKILL of rank 0) between its seal and DCP's ``.metadata``, which nothing
takes for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from ckptctl.format.seal import SEAL, parse_seal
from dist_workers import free_port
from helpers import cli

HERE = os.path.dirname(os.path.abspath(__file__))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _wait_for(path: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert all(p.poll() is None for p in procs), "a rank ended early: see its rankR.log"
        assert time.monotonic() < deadline, f"the job never wrote {path}"
        time.sleep(0.05)


def _run_job(base) -> dict:
    """Runs the 2-rank job; returns where it wrote, what each rank reported, and ``verify`` and
    ``latest`` of the root as they answered before the test flipped a bit."""
    root = str(base / "ckpt")
    os.makedirs(root)
    port = free_port()
    logs = [open(base / f"rank{r}.log", "w") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "integration_dcp_worker.py"), str(r), "2", str(port),
                               root], stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        _wait_for(str(base / "saved"), procs, 240)
        verified = cli("verify", root, "--latest", "--json")
        latest = cli("latest", root)
        _flip(os.path.join(root, "step-2", "__1_0.distcp"), 700)
        (base / "flipped").touch()
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    ranks = {}
    for r in range(2):
        assert os.path.exists(base / f"rank{r}.json"), (base / f"rank{r}.log").read_text()[-3000:]
        with open(base / f"rank{r}.json") as f:
            ranks[r] = json.load(f)
    return {"root": root, "ranks": ranks, "codes": [p.returncode for p in procs], "verified": verified,
            "latest": latest}


def test_two_ranks_save_async_save_load_refuse_a_flipped_bit_and_survive_a_kill(tmp_path) -> None:
    # One launch of the job for every check (each launch costs two torch imports).
    job = _run_job(tmp_path)
    root = job["root"]

    # save and async_save wrote sealed checkpoints that verify, and the Reader loads them back.
    assert job["verified"].exit_code == 0, job["verified"].stdout + job["verified"].stderr
    assert job["latest"].stdout.strip().endswith("step-2")
    for step in (1, 2):
        with open(os.path.join(root, f"step-{step}", SEAL), "rb") as f:
            seal = parse_seal(f.read(), SEAL)
        names = {f.name for f in seal.files}
        assert names == {".metadata", "__0_0.distcp", "__1_0.distcp"}, names  # both ranks' files, the commit file
        assert seal.layout == "dcp" and seal.step == step and seal.test_loaded == "written"
    assert all(job["ranks"][r]["loaded_equal"] for r in (0, 1)), job["ranks"]

    # A flipped bit: verify names the file; the Reader refuses on both ranks, no tensor changed.
    got = cli("verify", os.path.join(root, "step-2"))
    assert got.exit_code == 1 and "__1_0.distcp" in got.stdout + got.stderr, got.stdout + got.stderr
    for r in (0, 1):
        assert job["ranks"][r]["refused"] is not None, f"rank {r} loaded a damaged checkpoint"
        assert job["ranks"][r]["unchanged"], f"rank {r}'s state changed before the refusal"
    assert "__1_0.distcp bytes 0-" in job["ranks"][1]["refused"]

    # SIGKILL of rank 0 between the seal and DCP's .metadata: a partial nothing resumes from.
    assert job["codes"][0] == -9, job["codes"]
    step3 = os.path.join(root, "step-3")
    assert os.path.exists(os.path.join(step3, SEAL)) and not os.path.exists(os.path.join(step3, ".metadata"))
    entries = {e["name"]: e["status"] for e in json.loads(cli("ls", root, "--json").stdout)["checkpoints"]}
    assert entries["step-3"] == "partial", entries
    latest = cli("latest", root)
    assert latest.exit_code == 0 and latest.stdout.strip().endswith("step-1"), latest.stdout + latest.stderr

    # Saving that step again replaces what the dead save left (its seal, rank 1's file)...
    import torch.distributed.checkpoint as dcp

    from ckptctl.integrations.dcp import Writer

    again = os.path.join(str(tmp_path), "again", "step-3")
    shutil.copytree(step3, again)
    dcp.save({"w": torch.ones(3)}, storage_writer=Writer(again), no_dist=True)
    assert cli("verify", again).exit_code == 0
    # ... and a committed step is never written over.
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=Writer(again), no_dist=True)


def test_s3_save_verify_and_refused_load(s3_url: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptctl.integrations.dcp import Reader, Writer
    from ckptctl.storage import open_storage

    url = f"{s3_url}/step-5"
    saved = {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "train_state": {"step": 5}}
    dcp.save(saved, storage_writer=Writer(url), no_dist=True)
    assert cli("verify", url).exit_code == 0
    back = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}
    dcp.load(back, storage_reader=Reader(url), no_dist=True)
    assert torch.equal(back["model"]["w"], saved["model"]["w"]) and back["train_state"]["step"] == 5
    st = open_storage(url)
    raw = bytearray(st.read("__0_0.distcp"))
    raw[len(raw) // 2] ^= 1
    st.write_atomic("__0_0.distcp", bytes(raw))
    got = cli("verify", url)
    assert got.exit_code == 1 and "__0_0.distcp" in got.stdout + got.stderr
    target = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}
    with pytest.raises(CheckpointException, match="__0_0.distcp bytes"):
        dcp.load(target, storage_reader=Reader(url), no_dist=True)
    assert torch.equal(target["model"]["w"], torch.zeros(4096))


def test_the_torchtitan_recipe_in_docs_extending_routes_checkpoint_id_through_writer_and_reader(tmp_path,
                                                                                                 monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    text = open(os.path.join(HERE, "..", "docs", "extending.md")).read()
    recipe = text.split("torchtitan calls `dcp.save`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    for name in ("save", "async_save", "load"):  # put torch's functions back afterwards
        monkeypatch.setattr(dcp, name, getattr(dcp, name))
    exec(compile(recipe, "docs/extending.md", "exec"), {})
    path = str(tmp_path / "step-10")
    saved = {"model": {"w": torch.arange(8.0)}, "train_state": {"step": 10}}  # resumable: not a model-only export
    dcp.save(saved, checkpoint_id=path, no_dist=True)  # as torchtitan calls it
    assert os.path.exists(os.path.join(path, SEAL)) and cli("verify", path).exit_code == 0
    # A seal taken while writing vouches for the bytes, not for a test-load: prune's anchor
    # check still test-loads the checkpoint rather than take the seal for the load level.
    plan = json.loads(cli("prune", str(tmp_path), "--keep-last", "1", "--dry-run", "--json").stdout)["plan"]
    anchor = next(i for i in plan["items"] if i["name"] == "step-10")["verification"]
    assert anchor["ok"] and anchor["level"] == "load" and "stand for the load level" not in anchor["note"], anchor
    back = {"model": {"w": torch.zeros(8)}, "train_state": {"step": 0}}
    dcp.load(back, checkpoint_id=path, no_dist=True)
    assert torch.equal(back["model"]["w"], saved["model"]["w"]) and back["train_state"]["step"] == 10
    _flip(os.path.join(path, "__0_0.distcp"), 600)
    with pytest.raises(CheckpointException, match="__0_0.distcp bytes"):
        dcp.load({"model": {"w": torch.zeros(8)}, "train_state": {"step": 0}}, checkpoint_id=path, no_dist=True)
