"""The temporaries killed ckptctl writes leave (``.NAME.tmp-PID-HEX``), and what ``du`` counts
of what killed runs left: prune plans each temporary as a ``temporary`` item, deletes it only
once idle for ``--partial-after`` and only while exactly as planned, never while no checkpoint
verifies, never a file of another name, a directory or a link; ``du`` lists them and the
restores' staging copies apart from the checkpoints and totals them.

The temporaries here are left the way a kill leaves them: a process writing through the
filesystem backend's own atomic writer (what the verification record, the root lock, a
DeepSpeed ``latest``, a seal are written with) is SIGKILLed in the middle of its file. Ages are
set with ``os.utime``: the idle rule reads modification times, nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import step_dir
from ckptctl.format.seal import SEAL
from ckptctl.ops.retention.policies import from_options
from ckptctl.ops.retention.prune import execute
from ckptctl.ops.retention.prune import plan as make_plan
from ckptctl.ops.transfer.copy import copy_checkpoint
from ckptctl.storage import open_storage
from helpers import cli
from test_layouts import deepspeed_tag, hf_checkpoint

HOUR = 3600.0
STAGED = f".restore-staging-{step_dir(200)}.0123456789abcdef"  # a restore's name, spelt out
WRITER = """
import sys, time
from ckptctl.storage import open_storage
writer = open_storage(sys.argv[1]).open_writer(sys.argv[2])
writer.write(b"x" * int(sys.argv[3]))
print("writing", flush=True)
time.sleep(600)
"""


def _save(root: str, steps=(100, 200)) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"model": {f"w{i}": torch.full((1000,), float(s + i)) for i in range(4)}}).wait()


def _killed_mid_write(directory: str, name: str, size: int = 1000) -> str:
    """SIGKILL a process writing ``name`` in ``directory`` with the backend's atomic writer,
    ``size`` bytes in; the path of the temporary it left."""
    before = set(os.listdir(directory))
    p = subprocess.Popen([sys.executable, "-c", WRITER, directory, name, str(size)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "writing\n"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    (left,) = set(os.listdir(directory)) - before
    assert left.startswith(f".{name}.tmp-{p.pid}-"), left  # named as every ckptctl temporary
    return os.path.join(directory, left)


def _age(path: str, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when), follow_symlinks=False)


def _items(r) -> dict:
    assert r.exit_code in (0, 1), r.stdout + r.stderr
    return {i["name"]: i for i in r.json()["plan"]["items"]}


def test_a_write_killed_mid_file_leaves_a_temporary_prune_deletes_once_idle_and_never_before(tmp_path):
    root = str(tmp_path / "root")
    _save(root)
    assert cli("prune", root, "--keep-last", "2", "--yes").exit_code == 0  # writes the real record
    tmp = _killed_mid_write(root, ".ckptctl-verified.json", 1000)
    name = os.path.basename(tmp)

    young = _items(cli("prune", root, "--keep-last", "2", "--dry-run", "--json"))
    assert young[name]["status"] == "temporary" and young[name]["action"] == "skip", young[name]
    assert young[name]["bytes"] == 1000 and young[name]["step"] == -1
    assert "left alone until idle for 6h" in young[name]["reason"], young[name]
    r = cli("prune", root, "--keep-last", "2", "--yes")
    assert r.exit_code == 0 and os.path.exists(tmp), r.stdout + r.stderr

    _age(tmp, 7 * HOUR)
    text = cli("prune", root, "--keep-last", "2", "--dry-run")
    row = next(line for line in text.stdout.splitlines() if name in line)
    assert row.split()[:2] == ["-", "delete"] and "abandoned: the temporary of a ckptctl write" in row, text.stdout
    assert os.path.exists(tmp)  # a dry run deletes nothing
    r = cli("prune", root, "--keep-last", "2", "--yes", "--json")
    assert r.exit_code == 0 and r.json()["outcome"]["deleted"] == [name], r.stdout + r.stderr
    assert not os.path.exists(tmp)
    assert json.loads(open(os.path.join(root, ".ckptctl-verified.json"), "rb").read())  # the record itself stays
    for s in (100, 200):
        assert cli("verify", os.path.join(root, step_dir(s))).exit_code == 0


def test_prune_takes_exactly_its_temporaries_never_a_lookalike_a_directory_or_a_link(tmp_path):
    root, outside = str(tmp_path / "root"), tmp_path / "outside"
    _save(root)
    ours = os.path.basename(_killed_mid_write(root, "latest"))
    fresh = os.path.basename(_killed_mid_write(root, ".ckptctl-lock"))
    lookalikes = ["notes.tmp-123-0badf00d", ".notes.tmp-123-0BADF00D", ".notes.tmp-x1-0badf00d", ".notes.tmp",
                  ".notes.tmp-123-", "..tmp-123-0badf00d", ".notes.tmp-123-0badf00d.bak"]
    for n in lookalikes:
        (tmp_path / "root" / n).write_bytes(b"a user's file")
    os.makedirs(os.path.join(root, ".dir.tmp-123-0badf00d"))
    (tmp_path / "root" / ".dir.tmp-123-0badf00d" / "data").write_bytes(b"a user's file")
    outside.mkdir()
    (outside / "target").write_bytes(b"not ckptctl's to delete")
    link = os.path.join(root, ".link.tmp-123-0badf00d")
    os.symlink(outside / "target", link)
    for n in [ours, *lookalikes, ".dir.tmp-123-0badf00d", ".dir.tmp-123-0badf00d/data", ".link.tmp-123-0badf00d"]:
        _age(os.path.join(root, n), 7 * HOUR)
    _age(str(outside / "target"), 7 * HOUR)

    planned = _items(cli("prune", root, "--keep-last", "2", "--dry-run", "--json"))
    temporaries = {n: i["action"] for n, i in planned.items() if i["status"] == "temporary"}
    assert temporaries == {ours: "delete", fresh: "skip"}, planned
    r = cli("prune", root, "--keep-last", "2", "--yes", "--json")
    assert r.exit_code == 0 and r.json()["outcome"]["deleted"] == [ours], r.stdout + r.stderr
    left = set(os.listdir(root))
    assert ours not in left and fresh in left
    assert set(lookalikes) | {".dir.tmp-123-0badf00d", ".link.tmp-123-0badf00d"} <= left
    assert (tmp_path / "root" / ".dir.tmp-123-0badf00d" / "data").read_bytes() == b"a user's file"
    assert os.path.islink(link) and (outside / "target").read_bytes() == b"not ckptctl's to delete"


def test_no_temporary_is_deleted_while_no_checkpoint_verifies(tmp_path):
    root = str(tmp_path / "root")
    _save(root, steps=(100,))
    shard = next(os.path.join(root, step_dir(100), n) for n in os.listdir(os.path.join(root, step_dir(100)))
                 if n.endswith(".safetensors"))
    with open(shard, "r+b") as f:  # one flipped byte in the tensor data: nothing verifies
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    tmp = _killed_mid_write(root, ".ckptctl-verified.json")
    _age(tmp, 7 * HOUR)
    dry = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
    item = _items(dry)[os.path.basename(tmp)]
    assert item["status"] == "temporary" and item["action"] == "skip", item
    assert "no checkpoint verifies" in item["reason"], item
    r = cli("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert os.path.exists(tmp)


def test_a_temporary_written_after_the_plan_is_left_in_place(tmp_path):
    """The plan saw it idle; its writer (on another host: no pid to ask) wrote again before
    the deletion: left alone, reported as skipped."""
    root = str(tmp_path / "root")
    _save(root)
    tmp = _killed_mid_write(root, "latest", 10)
    name = os.path.basename(tmp)
    later = make_plan(open_storage(root), from_options(2, None, None, ()), now=time.time() + 7 * HOUR)
    assert [(i.kind, i.action) for i in later.items if i.name == name] == [("temporary", "delete")]
    with open(tmp, "ab") as f:
        f.write(b"more")
    outcome = execute(later)
    assert [o.name for o in outcome.skipped] == [name], outcome.to_dict()
    assert open(tmp, "rb").read() == b"x" * 10 + b"more"


def test_temporaries_inside_other_stacks_checkpoints_go_once_idle_with_their_checkpoints_intact(tmp_path):
    """A seal killed writing its seal into a Trainer checkpoint, a cp killed writing a file of
    a DeepSpeed checkpoint that was complete already: prune deletes each temporary once idle
    and leaves the checkpoints verifying; a fresh one stays; one inside a partial checkpoint
    is not taken on its own (the directory goes whole once idle)."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    hf = [hf_checkpoint(root, s) for s in (100, 200)]
    for ckpt in hf:
        assert cli("seal", ckpt).exit_code == 0
    os.unlink(os.path.join(hf[0], SEAL))
    sealing = _killed_mid_write(hf[0], SEAL)  # the rerun's seal, killed
    fresh = _killed_mid_write(hf[1], SEAL)  # a seal's temporary: never read as a file of it
    ds = deepspeed_tag(root, 300)
    copying = _killed_mid_write(ds, "mp_rank_00_model_states.pt")
    partial = os.path.join(root, "checkpoint-400")
    os.makedirs(partial)
    inside_partial = _killed_mid_write(partial, "model.safetensors")
    for path in (sealing, copying):
        _age(path, 7 * HOUR)
    rel = {p: os.path.relpath(p, root) for p in (sealing, fresh, copying, inside_partial)}

    planned = _items(cli("prune", root, "--keep-last", "3", "--dry-run", "--json"))
    temporaries = {n: (i["action"], i["step"], i["layout"]) for n, i in planned.items() if i["status"] == "temporary"}
    assert temporaries == {rel[sealing]: ("delete", 100, "hf-trainer"), rel[fresh]: ("skip", 200, "hf-trainer"),
                           rel[copying]: ("delete", 300, "deepspeed")}, planned
    r = cli("prune", root, "--keep-last", "3", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert sorted(r.json()["outcome"]["deleted"]) == sorted([rel[sealing], rel[copying]])
    assert not os.path.exists(sealing) and not os.path.exists(copying)
    assert os.path.exists(fresh) and os.path.exists(inside_partial)
    for ckpt in (*hf, ds):
        v = cli("verify", ckpt)
        assert v.exit_code == 0, v.stdout + v.stderr
    assert cli("seal", hf[0]).exit_code == 0  # sealed again, nothing in the way


def _root_with_leftovers(root: str) -> tuple[str, int]:
    """Steps 100 and 200 committed, a killed restore's staging copy of step 200 and a killed
    write's temporary at the root; the temporary's name and the bytes of both."""
    _save(root)
    st = open_storage(root)
    copy_checkpoint(st.sub(step_dir(200)), st.sub(STAGED))
    staged = sum(i.size for i in st.sub(STAGED).list())
    tmp = _killed_mid_write(root, ".ckptctl-verified.json", 1234)
    return os.path.basename(tmp), staged + 1234


def test_du_counts_what_killed_runs_left_apart_from_the_checkpoints(tmp_path):
    root = str(tmp_path / "root")
    name, left = _root_with_leftovers(root)
    before = cli("du", root, "--json").json()
    scratch = {e["name"]: e for e in before["scratch"]}
    assert sorted(scratch) == sorted([name, STAGED]), before
    assert scratch[STAGED]["status"] == "staging" and scratch[STAGED]["step"] == 200
    assert scratch[name]["status"] == "temporary" and scratch[name]["bytes"] == 1234 and scratch[name]["step"] == -1
    assert before["scratch_bytes"] == left and before["scratch_bytes_freed"] is None
    assert before["bytes"] == sum(c["bytes"] for c in before["checkpoints"])  # the checkpoints' own, as before
    text = cli("du", root)
    assert "of scratch (1 staging copy, 1 temporary" in text.stdout, text.stdout

    young = cli("du", root, "--keep-last", "2", "--json").json()
    assert young["scratch_bytes_freed"] == 0 and young["bytes_freed"] == 0, young
    assert {e["name"]: e["prune"] for e in young["scratch"]} == {name: "skip", STAGED: "skip"}
    idle = cli("du", root, "--keep-last", "2", "--partial-after", "0s", "--json").json()
    assert idle["scratch_bytes_freed"] == left, idle
    text = cli("du", root, "--keep-last", "2", "--partial-after", "0s")
    assert "will free 0 B (0 checkpoints), and" in text.stdout, text.stdout

    r = cli("prune", root, "--keep-last", "2", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0 and sorted(r.json()["outcome"]["deleted"]) == sorted([name, STAGED]), r.stdout + r.stderr
    after = cli("du", root, "--json").json()
    assert after["scratch"] == [] and after["scratch_bytes"] == 0 and after["bytes"] == before["bytes"]


def test_du_with_a_policy_counts_temporaries_inside_checkpoints_it_keeps_once(tmp_path):
    """A temporary inside a kept checkpoint is in that checkpoint's bytes, as du lists files;
    what prune would delete of it is in scratch_bytes_freed, not listed twice."""
    root = str(tmp_path / "root")
    _save(root)
    tmp = _killed_mid_write(os.path.join(root, step_dir(100)), "manifest.json.zombie", 777)
    _age(tmp, 7 * HOUR)
    doc = cli("du", root, "--keep-last", "2", "--json").json()
    assert doc["scratch"] == [] and doc["scratch_bytes"] == 0, doc
    assert doc["scratch_bytes_freed"] == 777 and doc["bytes_freed"] == 0, doc
    r = cli("prune", root, "--keep-last", "2", "--yes", "--json")
    assert r.json()["outcome"]["deleted"] == [os.path.relpath(tmp, root)], r.stdout + r.stderr


def test_du_and_prune_on_s3_count_a_staging_copy_and_take_no_temporary_name(s3_url, tmp_path):
    """On S3 a killed restore leaves its staging copy (du lists it); the backend writes every
    object in one PUT or one multipart upload, never under a temporary name, so an object named
    like one is not ckptctl's scratch there and is left alone."""
    src, dst = str(tmp_path / "src"), f"{s3_url}/dst"
    _save(src)
    st = open_storage(dst)
    for s in (100, 200):
        copy_checkpoint(open_storage(src).sub(step_dir(s)), st.sub(step_dir(s)))
    copy_checkpoint(open_storage(src).sub(step_dir(200)), st.sub(STAGED))
    st.write_atomic(".ckptctl-verified.json.tmp-123-0badf00d", b"someone's object")
    staged = sum(i.size for i in st.sub(STAGED).list())

    doc = cli("du", dst, "--json").json()
    assert [(e["name"], e["status"], e["bytes"]) for e in doc["scratch"]] == [(STAGED, "staging", staged)], doc
    assert doc["scratch_bytes"] == staged
    r = cli("prune", dst, "--keep-last", "2", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0 and r.json()["outcome"]["deleted"] == [STAGED], r.stdout + r.stderr
    assert st.stat(".ckptctl-verified.json.tmp-123-0badf00d") is not None
