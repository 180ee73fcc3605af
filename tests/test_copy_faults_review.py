"""The copy verbs against S3 under faults and concurrency, by experiment (a review's findings
kept as regression tests where the suite had no test of the same path).

* ``cp`` to S3 with each kind of request it makes failing: for good (exit 3, one line, nothing
  committed; the next plain run finishes), or answered but the answer lost on the way back (the
  request took effect; botocore's retry then finds the copy's own object there, which a
  conditional write answers with 412 and the copy must take as its own).
* Two ``cp`` processes into one S3 step, one held by its own proxy at a chosen request while the
  other runs to the end: of the same checkpoint both succeed (the held one's upload superseded,
  its name then found holding its own bytes); of different ones the held one is refused.
* ``sync`` to S3 SIGKILLed mid-upload, run again, then ``prune``: everything committed verifies
  and prune keeps what its policy keeps.

And the bugs the review found, each test failing on the commit before its fix: a copy at DST
rewritten within the second vouched for by sync (the S3 stamp lacked the ETag); a failed lock
release locking its own process out; sync --delete's storage error reported as exit 1; a
stack's pointer moved back by two copies at once; and conditional writes whose answer was lost
(the lock, its breaking guard, repoint's swap) taken for another writer's; and two re-sharding
restores of one step into one root, where one removed the step the other had just committed,
or took the shared staging copy the other had removed for a corrupt source and went back a step.

Everything runs through the real CLI (in-process ``cli``, or real processes) against moto's
server over HTTP, with ``tests/s3_fault_proxy.py`` between them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import boto3
import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.layouts.native_read import read_committed_raw
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy

MiB = 1 << 20
STEP = 100


def _save(root: str, fill: float, step: int = STEP) -> str:
    """One committed checkpoint whose shard is just over cp's 16 MiB multipart threshold (two
    parts), so a copy makes every kind of request: list, list uploads, create, part, complete,
    manifest PUT, marker PUT."""
    with Checkpointer(root) as ck:
        return ck.save(step, {"model": {"w": torch.full((4 * MiB + 1024,), fill)}, "extra": {"fill": fill}}).wait()


def _request_kind(method: str, path: str) -> str | None:
    """Which of cp's requests this is (path and query as the proxy sees them)."""
    where, _, query = path.partition("?")
    if method == "GET" and "list-type=2" in query:
        return "ListObjectsV2"
    if method == "GET" and query.startswith("uploads") and where.count("/") == 1:
        return "ListMultipartUploads"
    if method == "POST" and query == "uploads":
        return "CreateMultipartUpload"
    if method == "PUT" and "partNumber=" in query:
        return "UploadPart"
    if method == "POST" and "uploadId=" in query:
        return "CompleteMultipartUpload"
    if method == "PUT" and where.endswith("/manifest.json"):
        return "PutManifest"
    if method == "PUT" and where.endswith("/" + MARKER):
        return "PutMarker"
    return None


KINDS = ["ListObjectsV2", "ListMultipartUploads", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
         "PutManifest", "PutMarker"]


@pytest.fixture
def proxy(s3_server: str, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    try:
        yield p
    finally:
        p.stop()


def _one_line_error(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr


def _same_checkpoint(dst: str, src: str) -> None:
    """DST commits exactly SRC's checkpoint, and every byte of it verifies."""
    v = cli("verify", dst)
    assert v.exit_code == 0, v.stdout + v.stderr
    assert read_committed_raw(open_storage(dst)).manifest_raw == read_committed_raw(open_storage(src)).manifest_raw


def _lose_first(matches: Callable[[str, str], bool]) -> tuple[Callable[[str, str], str | None], list[str]]:
    """A proxy rule that loses the answer to the first request ``matches`` accepts (it is
    forwarded and takes effect), and the list of the paths it did that to."""
    lost: list[str] = []

    def rule(method: str, path: str) -> str | None:
        if lost or not matches(method, path):
            return None
        lost.append(path)
        return "lose"

    return rule, lost


def _holding(upstream: str, matches: Callable[[str, str], bool]) -> tuple[FaultProxy, threading.Event]:
    """A started proxy to ``upstream`` that holds every request ``matches`` accepts until its
    ``release`` is set, and the event set once it holds one."""
    held, reached = FaultProxy(upstream), threading.Event()

    def hold(method: str, path: str) -> str | None:
        if not matches(method, path) or held.release.is_set():
            return None
        reached.set()
        return "hold"

    held.rule = hold
    return held.start(), reached


def _restore_overtaken(upstream: str, src_root: str, dst_root: str,
                       holds: Callable[[str, str], bool]) -> tuple[subprocess.Popen, str, str]:
    """Restore B (a process, ``--world-size 2``) held at the first request ``holds`` accepts;
    meanwhile restore A (in-process) restores step 200 into the same root and must succeed;
    then B goes on. Returns B's process (ended), stdout and stderr."""
    held, reached = _holding(upstream, holds)
    try:
        second = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "restore", src_root, dst_root, "--world-size", "2"],
                                  env={**os.environ, "AWS_ENDPOINT_URL": held.url}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert reached.wait(240), second.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        first = cli("restore", src_root, dst_root, "--world-size", "2")
        assert first.exit_code == 0 and first.stdout.strip() == f"{dst_root}/{step_dir(200)}", first.stderr
        held.release.set()
        out, err = second.communicate(timeout=240)
    finally:
        held.release.set()
        held.stop()
    return second, out, err


def _put_of(name: str) -> Callable[[str, str], bool]:
    return lambda method, path: method == "PUT" and path.split("?")[0].endswith("/" + name)


@pytest.mark.parametrize("kind", KINDS)
def test_cp_to_s3_with_each_request_failing_for_good_or_losing_its_answer(kind, proxy, s3_url, tmp_path, monkeypatch):
    src = _save(str(tmp_path / "src"), 1.0)

    # Failing for good: exit 3, one line naming the object, nothing committed; a plain run again finishes.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy.rule = lambda method, path: "500" if _request_kind(method, path) == kind else None
    failed = f"{s3_url}/failed/{step_dir(STEP)}"
    r = cli("cp", src, failed)
    assert proxy.injected, f"cp made no {kind} request"
    assert r.exit_code == 3, r.stdout + r.stderr
    _one_line_error(r.stderr)
    assert "storage error" in r.stderr and "after retries" in r.stderr, r.stderr
    proxy.rule = lambda method, path: None
    assert open_storage(failed).stat(MARKER) is None
    again = cli("cp", src, failed)
    assert again.exit_code == 0, again.stderr
    _same_checkpoint(failed, src)

    # The first such request lands but its answer is lost: botocore's retry meets the copy's own
    # object (a conditional write answers 412 then), and the copy goes on as if it had been answered.
    proxy.injected.clear()
    proxy.rule, _ = _lose_first(lambda method, path: _request_kind(method, path) == kind)
    lost = f"{s3_url}/lost/{step_dir(STEP)}"
    r = cli("cp", src, lost)
    assert [a for a, _, _ in proxy.injected] == ["lose"]
    assert r.exit_code == 0, r.stderr
    _same_checkpoint(lost, src)


# --- two copies into one step, one held at a chosen request ----------------------------------


def _cp_process(src: str, dst: str, endpoint: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "cp", src, dst], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "AWS_ENDPOINT_URL": endpoint})


@pytest.mark.parametrize("same,held_at", [(True, "UploadPart"), (True, "CompleteMultipartUpload"), (True, "PutMarker"),
                                          (False, "UploadPart")])
def test_two_cp_processes_into_one_step_one_held(same, held_at, atomic_s3_url, tmp_path):
    """Copy A is held at its first ``held_at`` request (its own proxy) while copy B runs to the
    end; then A goes on. Of one checkpoint, B's writer of the shard aborts A's open upload (one
    writer per object), so a held part or completion meets NoSuchUpload, and both succeed with
    one set of files. Of two, A wrote its manifest before its data: B finds that name holding
    other bytes and is refused for safety (exit 1) before it sends data or aborts A's upload,
    and A commits (on main B committed and A was refused)."""
    a = _save(str(tmp_path / "a"), 1.0)
    b = a if same else _save(str(tmp_path / "b"), 2.0)
    upstream = os.environ["AWS_ENDPOINT_URL"]
    held, reached = _holding(upstream, lambda method, path: _request_kind(method, path) == held_at)
    dst = f"{atomic_s3_url}/{step_dir(STEP)}"
    try:
        first = _cp_process(a, dst, held.url)
        assert reached.wait(240), first.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        second = _cp_process(b, dst, upstream)
        out_b, err_b = second.communicate(timeout=240)
        held.release.set()
        out_a, err_a = first.communicate(timeout=240)
    finally:
        held.release.set()
        held.stop()
    if same:
        assert second.returncode == 0, err_b
        assert first.returncode == 0, err_a
        _same_checkpoint(dst, b)
        return
    assert second.returncode == 1, err_b
    _one_line_error(err_b)
    assert "another checkpoint's manifest" in err_b and "nothing was replaced" in err_b, err_b
    assert first.returncode == 0, err_a
    _same_checkpoint(dst, a)


# --- sync killed mid-upload, run again, then prune ---------------------------------------------


def test_sync_killed_mid_upload_then_run_again_and_pruned(s3_url, s3_server, tmp_path):
    """A ``sync`` of three checkpoints SIGKILLed while the second one's parts are in flight (the
    first committed, its lock left behind): the next run breaks the dead run's lock, completes
    the partial step and copies the third; all three verify as exactly SRC's; ``prune
    --keep-last 2`` deletes the oldest only and leaves no upload open."""
    local = str(tmp_path / "local")
    sources = {s: _save(local, float(s), step=s) for s in (100, 200, 300)}
    parts = []
    reached, release = threading.Event(), threading.Event()

    def hold_second_checkpoint(method: str, path: str) -> str | None:
        if _request_kind(method, path) != "UploadPart":
            return None
        parts.append(path)
        if "step-0000000100" in path:
            return None
        reached.set()
        release.wait()  # the proxy answers nobody meanwhile: the sync's parts stay in flight
        return "drop"

    proxy = FaultProxy(s3_server)
    proxy.rule = hold_second_checkpoint
    proxy.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "sync", local, s3_url],
                                env={**os.environ, "AWS_ENDPOINT_URL": proxy.url},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240  # a bound against hanging, not a timing assertion
            while not reached.is_set():
                assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
                assert time.monotonic() < deadline, "the sync never reached the second checkpoint's parts"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            release.set()
    finally:
        proxy.stop()
    assert proc.returncode == -signal.SIGKILL
    root = open_storage(s3_url)
    assert root.sub(step_dir(100)).stat(MARKER) is not None and root.sub(step_dir(200)).stat(MARKER) is None

    r = cli("sync", local, s3_url)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "broke a stale lock" in r.stdout + r.stderr
    for step, src in sources.items():
        _same_checkpoint(f"{s3_url}/{step_dir(step)}", src)

    p = cli("prune", s3_url, "--keep-last", "2", "--yes")
    assert p.exit_code == 0, p.stdout + p.stderr
    assert root.sub(step_dir(100)).stat(MARKER) is None
    for step in (200, 300):
        _same_checkpoint(f"{s3_url}/{step_dir(step)}", sources[step])
    bucket = s3_url[len("s3://"):].split("/", 1)[0]
    assert boto3.client("s3", endpoint_url=s3_server).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# --- a copy at DST rewritten within the second its record was made --------------------------


def _rewrite_within_the_second(s3_url: str, key: str) -> None:
    """Flip one byte of the object ``key`` below ``s3_url`` (same size), as another writer
    rewriting it within the same second would: S3 gives LastModified to the second, so the
    rewrite's LastModified equals the original's. moto stamps its own clock (finer), so its
    stamp is put back on the new object: only the listing's view of "when" is set, never the
    bytes or the ETag, which change as they would on S3."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    full = f"{prefix}/{key}"
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    before = backend.get_object(bucket, full)
    stamp = before.last_modified
    data = bytearray(before.value)
    data[-5] ^= 0x01
    backend.put_object(bucket, full, bytes(data))
    backend.get_object(bucket, full).last_modified = stamp


def test_sync_does_not_vouch_for_a_copy_rewritten_within_the_second(s3_url, tmp_path):
    """sync's "unchanged since verified" rests on DST's fingerprint. On S3 a file's stamp was
    its key, size and LastModified (one-second resolution): a same-size rewrite within the
    second left it unchanged, and sync called a damaged copy present and good (verify said
    otherwise). The ETag, in the same listing, changes with the bytes."""
    local = str(tmp_path / "local")
    src = _save(local, 1.0)
    assert cli("sync", local, s3_url).exit_code == 0
    shard = next(i.key for i in open_storage(f"{s3_url}/{step_dir(STEP)}").list() if i.key.endswith(".safetensors"))
    _rewrite_within_the_second(s3_url, f"{step_dir(STEP)}/{shard}")
    assert cli("verify", f"{s3_url}/{step_dir(STEP)}").exit_code == 1  # the copy is damaged

    r = cli("sync", local, s3_url, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    (item,) = r.json()["checkpoints"]
    assert item["action"] == "copied", item  # found damaged and completed again, not "present"
    _same_checkpoint(f"{s3_url}/{step_dir(STEP)}", src)


# --- a lock whose release failed, in a process that goes on ------------------------------------


def test_a_failed_lock_release_does_not_lock_its_own_process_out(proxy, s3_url, tmp_path, monkeypatch):
    """The store refuses the DELETE that releases DST's lock (past botocore's retries): that
    sync exits 3, the lock file stays. A later sync in the same process (a library user; the
    Checkpointer's retention prunes the same way, under the same lock) found the lock naming
    its own live pid and was refused for ``stale_after_s`` (6 h) behind itself. Nothing in the
    process holds it any more, so it is stale."""
    local = str(tmp_path / "local")
    src = _save(local, 1.0)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy.rule = lambda method, path: "500" if method == "DELETE" and path.split("?")[0].endswith("/.ckptctl-lock") else None
    r = cli("sync", local, s3_url)
    assert r.exit_code == 3 and ".ckptctl-lock" in r.stderr, r.stdout + r.stderr
    _one_line_error(r.stderr)
    proxy.rule = lambda method, path: None
    assert open_storage(s3_url).stat(".ckptctl-lock") is not None

    again = cli("sync", local, s3_url)
    assert again.exit_code == 0, again.stdout + again.stderr
    assert "broke a stale lock" in again.stdout + again.stderr
    _same_checkpoint(f"{s3_url}/{step_dir(STEP)}", src)
    assert open_storage(s3_url).stat(".ckptctl-lock") is None


# --- sync --delete when the store refuses the deletions -------------------------------------


def test_sync_delete_against_a_store_refusing_deletes_is_exit_3(proxy, s3_url, tmp_path, monkeypatch):
    """A DST checkpoint SRC no longer has, and S3 failing every DELETE past botocore's retries:
    an operational error (exit 3, one line naming the object), as a failing copy is; it was a
    'failed' item and exit 1, 'invalid checkpoint ... fix or delete the source checkpoint', which
    sends the person to a source that is fine. Nothing is lost, and the next run finishes."""
    local = str(tmp_path / "local")
    sources = {s: _save(local, float(s), step=s) for s in (100, 200)}
    extra = _save(str(tmp_path / "gone"), 3.0, step=50)
    assert cli("cp", extra, s3_url).exit_code == 0
    assert cli("sync", local, s3_url).exit_code == 0
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy.rule = lambda method, path: "500" if method == "DELETE" and "/step-" in path else None
    r = cli("sync", local, s3_url, "--delete")
    assert r.exit_code == 3, r.stdout + r.stderr
    _one_line_error(r.stderr)
    assert "storage error" in r.stderr and step_dir(50) in r.stderr, r.stderr
    proxy.rule = lambda method, path: None
    again = cli("sync", local, s3_url, "--delete")
    assert again.exit_code == 0, again.stdout + again.stderr
    assert [e.key for e in open_storage(s3_url).children() if e.kind == "dir"] == [step_dir(100), step_dir(200)]
    for step, src in sources.items():
        _same_checkpoint(f"{s3_url}/{step_dir(step)}", src)


# --- a stack's pointer at an S3 root, two copies at once --------------------------------------


def test_the_pointer_never_moves_back_when_two_copies_write_it_at_once(s3_url, s3_server, tmp_path):
    """Two ``cp`` of DeepSpeed tags into one S3 root: the older one's PUT of ``latest`` is held
    (its own proxy) after it judged the pointer absent, the newer one runs to the end and points
    ``latest`` at global_step20; then the held PUT lands. It replaced the pointer with
    global_step10, so DeepSpeed's default resume went back 10 steps, though a copy never moves
    the pointer to an older step; the write is now conditional on what was judged."""
    from test_layouts import deepspeed_tag

    root = str(tmp_path / "root")
    os.makedirs(root)
    old, new = deepspeed_tag(root, 10), deepspeed_tag(root, 20)
    for tag in (old, new):
        assert cli("seal", tag).exit_code == 0  # checked against the seal on the way: no test-load to wait for
    held, reached = _holding(s3_server, _put_of("latest"))
    try:
        first = _cp_process(old, s3_url, held.url)
        assert reached.wait(240), first.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        r = cli("cp", new, s3_url)
        assert r.exit_code == 0, r.stderr
        assert open_storage(s3_url).read("latest") == b"global_step20"
        held.release.set()
        _, err = first.communicate(timeout=240)
    finally:
        held.release.set()
        held.stop()
    assert first.returncode == 0, err
    assert open_storage(s3_url).read("latest") == b"global_step20"
    assert "names a newer step (20), left as is" in err, err


def test_a_lost_answer_to_the_lock_s_own_create_is_not_another_holder(proxy, s3_url, tmp_path):
    """The conditional PUT that takes DST's lock lands, its answer is lost, and botocore's retry
    gets 412: the lock file holds this very run's token. It was read as another holder (this
    pid, alive): sync exited 3 'held by pid N', naming itself, and left the lock behind."""
    local = str(tmp_path / "local")
    src = _save(local, 1.0)
    proxy.rule, seen = _lose_first(_put_of(".ckptctl-lock"))
    r = cli("sync", local, s3_url)
    assert seen and r.exit_code == 0, r.stdout + r.stderr
    assert "stale lock" not in r.stdout + r.stderr
    _same_checkpoint(f"{s3_url}/{step_dir(STEP)}", src)
    assert open_storage(s3_url).stat(".ckptctl-lock") is None


# --- a swap whose answer was lost --------------------------------------------------------------


def test_repoint_whose_pointer_swap_lost_its_answer_says_it_moved_it(proxy, s3_url, s3_server, tmp_path):
    """``repoint`` on S3 swaps DeepSpeed's ``latest`` with one PUT carrying ``If-Match``; it
    lands, the answer is lost, botocore's retry gets 412 (the ETag is now the new content's).
    The pointer held exactly what repoint wrote, yet it said 'changed while repoint judged it
    ... left as it is, not moved' and exited 1. A key holding the swap's own bytes is swapped."""
    from test_layouts import deepspeed_tag

    local = str(tmp_path / "root")
    os.makedirs(local)
    for step in (10, 20, 30):
        deepspeed_tag(local, step)  # `latest` names global_step30 last
    shard = os.path.join(local, "global_step30", "mp_rank_00_model_states.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    raw = boto3.client("s3", endpoint_url=s3_server)
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    for top, _dirs, files in os.walk(local):
        for name in files:
            path = os.path.join(top, name)
            raw.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, local)}")
    proxy.rule, seen = _lose_first(_put_of("latest"))
    r = cli("repoint", s3_url)
    assert seen, "repoint wrote no pointer"
    assert r.exit_code == 0 and "global_step30 -> global_step20" in r.stderr, r.stdout + r.stderr
    assert open_storage(s3_url).read("latest") == b"global_step20"


def test_a_lost_answer_to_the_breakers_own_guard_is_not_another_breaker(proxy, s3_url, tmp_path):
    """DST's lock was left by a process that is gone; breaking it takes a guard file with a
    conditional PUT. That PUT lands and its answer is lost: the guard read back holds this run's
    own token. It was read as another run breaking the lock right now: sync exited 3, and its
    guard kept every run from breaking the stale lock for 5 minutes."""
    import socket

    from ckptctl.ops.lock_info import LockInfo

    local = str(tmp_path / "local")
    src = _save(local, 1.0)
    gone = subprocess.Popen(["true"])
    gone.wait()
    now = time.time()
    left = LockInfo(socket.gethostname(), gone.pid, None, now, now, "ckptctl sync (killed)", "killed0token")
    open_storage(s3_url).write_atomic(".ckptctl-lock", left.to_json())
    proxy.rule, seen = _lose_first(_put_of(".ckptctl-lock.break"))
    r = cli("sync", local, s3_url)
    assert seen and r.exit_code == 0, r.stdout + r.stderr
    assert "broke a stale lock" in r.stdout + r.stderr
    _same_checkpoint(f"{s3_url}/{step_dir(STEP)}", src)
    root = open_storage(s3_url)
    assert root.stat(".ckptctl-lock") is None and root.stat(".ckptctl-lock.break") is None


# --- two re-sharding restores into one root ----------------------------------------------------


def test_two_resharding_restores_into_one_root_never_delete_the_committed_step(s3_url, s3_server):
    """Restore B (``--world-size 2``) is held at the listing ``reshard`` makes of the target
    step, after it judged the step uncommitted; restore A runs to the end meanwhile: step 200
    re-sharded, committed, verified, the (shared) staging copy removed. Then B went on:
    ``prepare_target`` with the ``overwrite`` B had decided from its earlier look found A's
    marker and removed A's committed step; B then found the staging copy gone, took that for
    the source failing verification, skipped step 200 and restored step 100, exit 0: the root
    ended with step 100 only, though A had said it restored step 200. Now a target committed
    meanwhile is refused, never removed, and judged: this very checkpoint re-sharded, so B
    says "already present"."""
    src_root, dst_root = f"{s3_url}/src", f"{s3_url}/dst"
    with Checkpointer(src_root) as ck:
        for s in (100, 200):
            ck.save(s, {"model": {f"w{i}": torch.full((1000,), float(s + i)) for i in range(4)}}).wait()
    prefix = s3_url[len("s3://"):].split("/", 1)[1]
    target = f"prefix={prefix}/dst/{step_dir(200)}/".replace("/", "%2F")
    second, out, err = _restore_overtaken(s3_server, src_root, dst_root, lambda method, path: method == "GET"
                                          and "list-type=2" in path and target in path and "delimiter" not in path)
    assert cli("verify", f"{dst_root}/{step_dir(200)}").exit_code == 0, "the step restore A reported was deleted"
    assert second.returncode == 0 and out.strip() == f"{dst_root}/{step_dir(200)}", f"restore B: {out} {err}"
    assert "already holds step 200" in err, err
    assert _staging_left(dst_root) == []


def test_a_resharding_restore_whose_staging_copy_another_removed_never_falls_back(s3_url, s3_server):
    """Restore B is held at the marker of its staging copy (every file of it copied and
    checked); restore A, meanwhile, finds those files holding its own bytes, commits the
    staging copy, re-shards step 200 into the target and removes the staging copy. B's marker
    then lands on a staging copy without files; re-sharding from it failed, that failure was
    taken for the source failing verification, and B restored step 100 (exit 0). The source
    was checked byte for byte as it was copied: a problem with the staging copy afterwards is
    this root's, judged again (here: the step is there, re-sharded), never a reason to go back.
    With a staging copy per run, A never sees B's: B re-shards from its own, finds the step
    committed, says so, and removes its copy; the root is left with none (with one shared
    name, B's marker stayed behind in the emptied directory)."""
    src_root, dst_root = f"{s3_url}/src", f"{s3_url}/dst"
    with Checkpointer(src_root) as ck:
        for s in (100, 200):
            ck.save(s, {"model": {f"w{i}": torch.full((1000,), float(s + i)) for i in range(4)}}).wait()
    staging = f"/dst/.restore-staging-{step_dir(200)}"  # B's own (a run id follows), or the one shared by both
    second, out, err = _restore_overtaken(s3_server, src_root, dst_root, lambda method, path: method == "PUT"
                                          and staging in path and path.split("?")[0].endswith("/" + MARKER))
    assert cli("verify", f"{dst_root}/{step_dir(200)}").exit_code == 0
    assert open_storage(dst_root).sub(step_dir(100)).stat(MARKER) is None, f"restore B fell back to step 100: {err}"
    assert second.returncode == 0 and out.strip() == f"{dst_root}/{step_dir(200)}", f"restore B: {out} {err}"
    assert _staging_left(dst_root) == [], "a staging copy outlived both restores"


def _staging_left(root: str) -> list[str]:
    """The hidden staging directories under ``root``: none once every restore into it ended.
    When two restores of one step shared one (per-step) name, B's marker landed in the copy A
    had removed and stayed there, hidden from every lister, for good."""
    return [c.key for c in open_storage(root).children() if c.key.startswith(".restore-staging-")]
