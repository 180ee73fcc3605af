"""A stack's pointer names a broken checkpoint (resume-truth issue, #20).

DeepSpeed's ``load_checkpoint(ROOT)`` loads the tag in ``ROOT/latest``; Megatron's ``--load
ROOT`` the iteration in ``latest_checkpointed_iteration.txt``. Roots are laid out as those
stacks' sources write them (``test_layouts.deepspeed_tag``, ``megatron_iter``), and the
pointer's target is cut short after the pointer was written (DeepSpeed writes ``latest`` before
its final barrier; a disk can lose the tail of any file). Then ``verify --latest`` must fail
naming both, ``latest`` must not hand over a path that resumes the broken one, ``--resume-args``
must name the good one, and ``repoint`` must move the pointer back so the stack's default
resume is safe again.
"""

from __future__ import annotations

import os

from helpers import cli
from test_layouts import deepspeed_tag, megatron_iter

TRACKER = "latest_checkpointed_iteration.txt"


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _megatron_root(root: str) -> None:
    for it in (20, 25, 30):
        megatron_iter(root, it)  # the tracker names 30 last
    _truncate(os.path.join(root, "iter_0000030", "mp_rank_00", "model_optim_rng.pt"))


def _deepspeed_root(root: str) -> None:
    for s in (10, 20, 30):
        deepspeed_tag(root, s)  # `latest` names global_step30 last
    _truncate(os.path.join(root, "global_step30", "mp_rank_00_model_states.pt"))


def test_megatron_latest_plain_output_refuses_when_the_tracker_names_a_broken_iteration(tmp_path):
    root = str(tmp_path)
    _megatron_root(root)
    r = cli("latest", root, "--format", "megatron")
    assert r.exit_code == 1 and r.stdout == "", (r.stdout, r.stderr)  # printing ROOT would resume iteration 30
    assert "--resume-args" in r.stderr and "ckptctl repoint" in r.stderr and TRACKER in r.stderr
    r = cli("latest", root, "--format", "megatron", "--resume-args")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"--load {root} --ckpt-step 25"
    doc = cli("latest", root, "--json").json()
    assert doc["resume"]["argv"] == ["--load", root, "--ckpt-step", "25"] and doc["resume"]["exact"] is False
    assert doc["resume"]["option"].startswith(f"--load {root}")  # the field external scripts read stays


def test_megatron_verify_latest_names_the_tracker_and_repoint_moves_it_back(tmp_path):
    root = str(tmp_path)
    _megatron_root(root)
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert TRACKER in r.stdout and "iter_0000030" in r.stdout and "iter_0000025" in r.stdout
    assert f"ckptctl repoint {root} --format megatron" in r.stdout
    doc = cli("verify", root, "--latest", "--json").json()
    (p,) = doc["pointers"]
    assert not doc["ok"] and p["target"] == "iter_0000030" and p["verifies"]["step"] == 25

    r = cli("repoint", root, "--dry-run", "--json")
    assert r.exit_code == 0 and r.json()["new"] == "25" and not r.json()["changed"], r.stdout + r.stderr
    assert open(os.path.join(root, TRACKER)).read() == "30"  # a dry run writes nothing
    r = cli("repoint", root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["old"] == "30" and r.json()["new_target"] == "iter_0000025" and r.json()["changed"]
    assert open(os.path.join(root, TRACKER)).read() == "25"  # as Megatron writes it
    assert not [n for n in os.listdir(root) if n.startswith(".") and n != ".ckptctl-lock"]  # no temporary left
    assert cli("verify", root, "--latest").exit_code == 0
    r = cli("latest", root, "--format", "megatron")
    assert r.exit_code == 0 and r.stdout.strip() == root  # --load ROOT now loads exactly iteration 25
    r = cli("repoint", root)
    assert r.exit_code == 0 and "nothing to do" in r.stderr


def test_deepspeed_broken_latest_target_verify_latest_resume_args_repoint(tmp_path):
    root = str(tmp_path)
    _deepspeed_root(root)
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "pointer latest" in r.stdout and "global_step30" in r.stdout and "global_step20" in r.stdout
    r = cli("latest", root, "--format", "deepspeed")
    assert r.exit_code == 1 and r.stdout == ""  # load_checkpoint(ROOT) would load global_step30
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0 and r.stdout.strip() == f"--load_dir {root} --tag global_step20"
    r = cli("repoint", root)
    assert r.exit_code == 0 and "global_step30 -> global_step20" in r.stderr, r.stderr
    assert open(os.path.join(root, "latest")).read() == "global_step20"  # as save_latest writes it
    assert cli("verify", root, "--latest").exit_code == 0
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == root


def test_repoint_never_moves_forward_and_refuses_when_nothing_older_verifies(tmp_path):
    root = str(tmp_path)
    deepspeed_tag(root, 10)
    deepspeed_tag(root, 20)
    _truncate(os.path.join(root, "global_step10", "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step10")  # global_step20 is newer than `latest`: never committed, never a target
    r = cli("repoint", root, "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "no older DeepSpeed checkpoint verifies" in r.json()["error"]["message"]
    assert open(os.path.join(root, "latest")).read() == "global_step10"


def test_repoint_usage_errors(tmp_path):
    root = str(tmp_path)
    r = cli("repoint", root)
    assert r.exit_code == 2 and "nothing to repoint" in r.stderr
    megatron_iter(root, 10)
    deepspeed_tag(root, 10)
    r = cli("repoint", root)
    assert r.exit_code == 2 and "--format" in r.stderr
    r = cli("repoint", root, "--format", "megatron")
    assert r.exit_code == 0 and "nothing to do" in r.stderr


def test_tracker_naming_a_missing_iteration_fails_verify_latest_and_is_moved_back(tmp_path):
    root = str(tmp_path)
    megatron_iter(root, 10)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("40")  # the tracker outlived its iteration (deleted by hand, or never copied)
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1 and "iter_0000040" in r.stdout and "iter_0000010" in r.stdout, r.stdout + r.stderr
    r = cli("latest", root)
    assert r.exit_code == 1 and r.stdout == ""
    assert cli("repoint", root).exit_code == 0
    assert open(os.path.join(root, TRACKER)).read() == "10"
    assert cli("verify", root, "--latest").exit_code == 0


def test_repoint_takes_the_roots_lock_and_a_dry_run_does_not(tmp_path):
    from ckptctl.ops.lock import RootLock
    from ckptctl.storage import open_storage

    root = str(tmp_path)
    _deepspeed_root(root)
    with RootLock(open_storage(root), command="prune (another run)"):
        r = cli("repoint", root)
        assert r.exit_code == 3, r.stdout + r.stderr  # held by a live process: nothing written
        assert open(os.path.join(root, "latest")).read() == "global_step30"
        assert cli("repoint", root, "--dry-run").exit_code == 0
    assert cli("repoint", root).exit_code == 0
    assert open(os.path.join(root, "latest")).read() == "global_step20"


# --- a save that rewrites the pointer while repoint runs (issue 29, item 3) -----------------
# The concurrent writer is a real second process doing what DeepSpeed's save_checkpoint does
# last: ``open(ROOT/latest, "w").write(tag)`` in place. It runs while repoint's new pointer is
# being made durable (a slowed fsync) or just before repoint's rename, through a wrapper of the
# operating system call that repoint's storage makes; nothing of ckptctl's is replaced.

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def _save_rewrites_latest(root: str, tag: str) -> None:
    subprocess.run([sys.executable, "-c", f"open({os.path.join(root, 'latest')!r}, 'w').write({tag!r})"], check=True)


def _is_pointer_temporary(path: str) -> bool:
    return os.path.basename(path).startswith(".latest.tmp-")


@pytest.mark.parametrize("when", ["while the new pointer is fsynced", "just before the rename"])
def test_repoint_never_moves_latest_back_over_a_newer_tag_a_save_wrote_meanwhile(tmp_path, monkeypatch, when):
    root = str(tmp_path)
    _deepspeed_root(root)  # latest names global_step30, which is cut short; global_step20 verifies
    deepspeed_tag(root, 99, latest=False)  # the save in flight: its files are written, `latest` comes last
    real_fsync, real_rename, fired = os.fsync, os.rename, []

    def fire() -> None:
        if not fired:
            fired.append(when)
            _save_rewrites_latest(root, "global_step99")

    def slow_fsync(fd: int) -> None:
        if when == "while the new pointer is fsynced" and _is_pointer_temporary(os.readlink(f"/proc/self/fd/{fd}")):
            fire()
        real_fsync(fd)

    def late_rename(src, dst, **kwargs) -> None:
        if when == "just before the rename" and _is_pointer_temporary(str(src)) and str(dst) == "latest":
            fire()
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(os, "rename", late_rename)
    r = cli("repoint", root)
    monkeypatch.undo()
    assert fired == [when]
    assert open(os.path.join(root, "latest")).read() == "global_step99", r.stderr  # the save's pointer stands
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "'global_step30'" in r.stderr and "'global_step99'" in r.stderr and "not moved to global_step20" in r.stderr
    assert not [n for n in os.listdir(root) if ".tmp-" in n]  # nothing left behind
    assert cli("verify", root, "--latest").exit_code == 0


def test_compare_and_swap_on_s3_loses_to_a_writer_between_its_read_and_its_write(s3_server, s3_url):
    """On S3 the swap is one PUT with ``If-Match``: another client's PUT that lands after the
    swap read the pointer (made here by the proxy, just before forwarding the swap's PUT) wins."""
    import boto3

    from ckptctl.storage import open_storage
    from s3_fault_proxy import FaultProxy

    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    other = boto3.client("s3", endpoint_url=s3_server)
    proxy = FaultProxy(s3_server).start()
    try:
        st = open_storage(s3_url, endpoint_url=proxy.url)
        st.write_atomic("latest", b"global_step30")
        assert st.compare_and_swap("latest", b"global_step10", b"global_step20") == b"global_step30"  # judged stale
        assert st.read("latest") == b"global_step30"

        def rule(method: str, path: str) -> None:
            if method == "PUT" and path.split("?")[0].endswith("/latest") and not proxy.injected:
                proxy.injected.append(("write", method, path))
                other.put_object(Bucket=bucket, Key=f"{prefix}/latest", Body=b"global_step99")
            return None

        proxy.rule = rule
        assert st.compare_and_swap("latest", b"global_step30", b"global_step20") == b"global_step99"
        assert other.get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read() == b"global_step99"
        proxy.rule = lambda method, path: None
        assert st.compare_and_swap("latest", b"global_step99", b"global_step20") == b"global_step99"  # swapped
        assert st.read("latest") == b"global_step20"
        assert st.compare_and_swap("new", None, b"x") is None and st.read("new") == b"x"  # absent: If-None-Match
        assert st.compare_and_swap("new", None, b"y") == b"x" and st.read("new") == b"x"
    finally:
        proxy.stop()
