"""restore / cp judge the destination honestly: an existing copy is re-verified before it is
trusted, a destination problem is the destination's error (exit 3), and a killed run's
temporaries are cleaned up by the next successful one. Faults are made with real files."""

from __future__ import annotations

import os

from ckptctl.format.layout import MARKER, step_dir
from helpers import ckpt_dir, cli, dead_pid, make_checkpoints


def _flip_a_data_byte(ckpt: str) -> None:
    shard = next(n for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors"))
    with open(os.path.join(ckpt, shard), "r+b") as f:
        f.seek(-5, 2)
        b = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_onto_a_damaged_copy_replaces_it(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2, 3])
    assert cli("restore", src, dst).exit_code == 0
    _flip_a_data_byte(ckpt_dir(dst, 3))
    assert cli("verify", ckpt_dir(dst, 3)).exit_code == 1
    r = cli("restore", src, dst, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["step"] == 3 and doc["copy"]["status"] == "copied"
    assert cli("verify", ckpt_dir(dst, 3)).exit_code == 0
    # and a good copy is left as is
    assert cli("restore", src, dst, "--json").json()["copy"]["status"] == "already present"


def test_cp_onto_a_damaged_copy_replaces_it(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [4])
    assert cli("cp", ckpt_dir(src, 4), dst).exit_code == 0
    _flip_a_data_byte(ckpt_dir(dst, 4))
    r = cli("cp", ckpt_dir(src, 4), dst, "--json")
    assert r.exit_code == 0 and r.json()["status"] == "copied"
    assert cli("verify", ckpt_dir(dst, 4)).exit_code == 0


def test_a_symlinked_destination_step_is_a_destination_error(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [10, 20, 30])
    os.makedirs(dst)
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ckpt_dir(dst, 30))
    r = cli("restore", src, dst)
    assert r.exit_code == 3, (r.stdout, r.stderr)
    assert ckpt_dir(dst, 30) in r.stderr and "skipping" not in r.stderr.lower()
    assert sorted(os.listdir(dst)) == [step_dir(30)]  # no older step restored instead
    assert os.listdir(tmp_path / "elsewhere") == []  # nothing written through the link


def test_a_killed_runs_temporaries_are_removed_by_the_next_run(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [7])
    target = ckpt_dir(dst, 7)
    os.makedirs(target)
    shard = next(n for n in os.listdir(ckpt_dir(src, 7)) if n.endswith(".safetensors"))
    pid = dead_pid()
    left = [f".{shard}.tmp-{pid}-0a1b2c3d", f".manifest.json.tmp-{pid}-deadbeef"]
    for name in left + [".keep-me"]:
        with open(os.path.join(target, name), "wb") as f:
            f.write(b"x" * 100)
    r = cli("restore", src, dst)
    assert r.exit_code == 0, r.stderr
    names = set(os.listdir(target))
    assert not names & set(left) and ".keep-me" in names and MARKER in names
    assert cli("verify", target).exit_code == 0
