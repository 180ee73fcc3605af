"""A ``seal`` or a ``cp`` of another tool's checkpoint killed at any point, then run again
(trust issue, cases 14 and 15): the rerun removes the temporaries the kill left before it
decides anything, and never reports a copy done that ``verify`` then fails.

Each kill point is recreated exactly as a SIGKILL leaves it: the files the run had committed,
and the hidden temporary (``.NAME.tmp-PID-HEX``, named as ``storage.local_io`` names it, with
the pid of a process that is gone) of the file it was writing: partly written, fully written
but not linked, or linked into place but not yet unlinked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from ckptctl.format.seal import SEAL
from helpers import cli, dead_pid
from test_layouts import deepspeed_tag, hf_checkpoint

HF_COMMIT = "trainer_state.json"


def temporary(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.tmp-{dead_pid()}-0badf00d")


def sealed_hf(tmp_path: Any) -> tuple[str, str]:
    root = str(tmp_path / "root")
    os.makedirs(root)
    ckpt = hf_checkpoint(root, 100)
    r = cli("seal", ckpt)
    assert r.exit_code == 0, r.stdout + r.stderr
    return root, ckpt


# --- case 14: seal --------------------------------------------------------------------------

@pytest.mark.parametrize("point", ["partly written", "written, not linked", "linked, not unlinked"])
def test_a_killed_seal_leaves_nothing_the_rerun_trusts(tmp_path: Any, point: str) -> None:
    root, ckpt = sealed_hf(tmp_path)
    seal = open(os.path.join(ckpt, SEAL), "rb").read()
    tmp = temporary(ckpt, SEAL)
    if point == "linked, not unlinked":
        os.link(os.path.join(ckpt, SEAL), tmp)
    else:
        os.unlink(os.path.join(ckpt, SEAL))
        open(tmp, "wb").write(seal if point == "written, not linked" else seal[: len(seal) // 2])
    # Before the rerun: the seal's temporary is never read as the seal, nor as a file the seal
    # does not cover, so the intact checkpoint verifies at every kill point (issue 29, item 7).
    r = cli("verify", ckpt)
    assert r.exit_code == 0 and "interrupted ckptctl" not in r.stdout + r.stderr, r.stdout + r.stderr
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt, r.stdout + r.stderr
    r = cli("seal", ckpt, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert not os.path.exists(tmp), "the rerun removes the leftover"
    files = [f["name"] for f in json.loads(open(os.path.join(ckpt, SEAL)).read())["files"]]
    assert not any(".tmp-" in f for f in files), files
    r = cli("verify", ckpt)
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt


def test_a_running_writers_temporary_is_left_alone(tmp_path: Any) -> None:
    root, ckpt = sealed_hf(tmp_path)
    live = os.path.join(ckpt, f".{SEAL}.tmp-{os.getpid()}-0badf00d")  # this process: still running
    open(live, "wb").write(b"{")
    r = cli("seal", ckpt)
    assert r.exit_code == 0 and os.path.exists(live)


# --- case 15: cp ----------------------------------------------------------------------------

def copy_order(src: str) -> list[str]:
    """The files in the order ``cp`` commits them: data files, the commit file, the seal."""
    names = sorted(n for n in os.listdir(src) if n != SEAL)
    data = [n for n in names if n != HF_COMMIT]
    return data + [HF_COMMIT] + ([SEAL] if os.path.exists(os.path.join(src, SEAL)) else [])


def kill_points(src: str) -> list[tuple[int, str]]:
    order = copy_order(src)
    return [(i, how) for i in range(len(order)) for how in ("partly written", "linked, not unlinked")]


def recreate_kill(src: str, dst: str, order: list[str], i: int, how: str) -> None:
    """``dst`` as a cp killed while writing ``order[i]`` leaves it."""
    os.makedirs(dst)
    for name in order[:i]:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    name = order[i]
    tmp = temporary(dst, name)
    data = open(os.path.join(src, name), "rb").read()
    if how == "linked, not unlinked":  # write_if_absent's link, or a rename's twin on a crash
        open(os.path.join(dst, name), "wb").write(data)
        os.link(os.path.join(dst, name), tmp)
    else:
        open(tmp, "wb").write(data[: max(1, len(data) // 2)])


@pytest.mark.parametrize("sealed", [True, False])
def test_a_killed_cp_rerun_never_reports_a_copy_that_does_not_verify(tmp_path: Any, sealed: bool) -> None:
    root, src = sealed_hf(tmp_path)
    if not sealed:
        os.unlink(os.path.join(src, SEAL))
    order = copy_order(src)
    for n, (i, how) in enumerate(kill_points(src)):
        dst_root = str(tmp_path / f"dst{n}")
        dst = os.path.join(dst_root, "checkpoint-100")
        recreate_kill(src, dst, order, i, how)
        r = cli("cp", src, dst_root, "--json")
        where = f"killed while writing {order[i]} ({how})"
        assert r.exit_code == 0, (where, r.stdout, r.stderr)
        assert not [f for f in os.listdir(dst) if ".tmp-" in f], (where, os.listdir(dst))
        v = cli("verify", dst)
        assert v.exit_code == 0, (where, v.stdout, v.stderr)
        v = cli("latest", dst_root)
        assert v.exit_code == 0 and v.stdout.strip() == dst, (where, v.stdout, v.stderr)
        assert sorted(os.listdir(dst)) == sorted(os.listdir(src)), where


def test_a_killed_restore_of_deepspeed_writes_the_pointer_only_for_a_verified_copy(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    os.makedirs(root)
    src = deepspeed_tag(root, 10)
    assert cli("seal", src).exit_code == 0
    dst_root = str(tmp_path / "dst")
    dst = os.path.join(dst_root, "global_step10")
    names = sorted(n for n in os.listdir(src) if n != SEAL) + [SEAL]
    recreate_kill(src, dst, names, len(names) - 1, "partly written")  # killed writing the seal
    r = cli("restore", root, dst_root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert open(os.path.join(dst_root, "latest")).read().strip() == "global_step10"
    assert cli("verify", dst).exit_code == 0
    assert not [f for f in os.listdir(dst) if ".tmp-" in f]


def test_prune_never_seals_a_leftover_temporary_into_its_anchor(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    os.makedirs(root)
    hf_checkpoint(root, 100)
    anchor = hf_checkpoint(root, 200)
    tmp = temporary(anchor, "optimizer.pt")
    open(tmp, "wb").write(b"half a file")
    r = cli("prune", root, "--keep-last", "1", "--seal", "--yes", "--json")
    assert r.exit_code in (0, 1), r.stdout + r.stderr
    if os.path.exists(os.path.join(anchor, SEAL)):
        files = [f["name"] for f in json.loads(open(os.path.join(anchor, SEAL)).read())["files"]]
        assert os.path.basename(tmp) not in files, files
    assert "not sealed" in r.stdout + r.stderr, r.stdout


@pytest.mark.slow
def test_a_real_sigkill_mid_copy_then_the_rerun_verifies(tmp_path: Any) -> None:
    """The same as the recreated kill points, with a real SIGKILL of a real ``ckptctl cp`` while
    it is writing a temporary (waited for by watching the destination, not by time)."""
    import sys
    import time

    import torch
    from safetensors.torch import save_file

    root = str(tmp_path / "root")
    os.makedirs(root)
    src = hf_checkpoint(root, 100)
    save_file({"w": torch.zeros(96 << 20)}, os.path.join(src, "model.safetensors"))  # 384 MiB: a long copy
    assert cli("seal", src).exit_code == 0
    dst_root = str(tmp_path / "dst")
    dst = os.path.join(dst_root, "checkpoint-100")
    p = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "cp", src, dst_root], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    killed = False
    while p.poll() is None:
        if os.path.isdir(dst) and any(".tmp-" in n for n in os.listdir(dst)):
            p.kill()  # SIGKILL: no handler runs, the temporary stays
            killed = True
            break
        time.sleep(0.002)
    p.wait()
    if not killed:
        pytest.skip("the copy finished before a temporary was seen; nothing was interrupted")
    assert any(".tmp-" in n for n in os.listdir(dst)), "a SIGKILL leaves the temporary"
    r = cli("cp", src, dst_root)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert not [n for n in os.listdir(dst) if ".tmp-" in n]
    assert cli("verify", dst).exit_code == 0
    assert cli("latest", dst_root).stdout.strip() == dst
