"""Two writers copying into one step never destroy what either commits (issue 29, item 1).

Every trial races two copies of *different* checkpoints of step 100 into one destination step,
on S3 (moto serving one request at a time, so conditional writes are atomic as on S3) and on a
local filesystem: at most one copy may report success, and the step then verifies and holds
exactly what that copy copied; the other is refused for safety (exit 1). The same for two
tiered jobs (a zombie and its restart) promoting one step to a shared S3 tier: a ``close()``
that says the step reached S3 means S3's step verifies and holds that job's checkpoint.

The trials run in threads of this process (each copy its own storage objects and clients, the
library's real code paths, talking HTTP to moto); ``CKPTCTL_RACE_TRIALS`` sets how many (the
suite runs a few; the issue's 50 are run with ``CKPTCTL_RACE_TRIALS=50``).
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from typing import Callable

import pytest
import torch

from ckptctl import Checkpointer, Tier
from ckptctl.errors import CkptError, RefusedForSafety
from ckptctl.format.layout import step_dir
from ckptctl.layouts.native import NativeLayout
from ckptctl.layouts.native_read import read_committed_raw
from ckptctl.ops.transform.reshard import reshard
from ckptctl.ops.transfer.copy import copy_checkpoint
from ckptctl.ops.transfer.files import Ends, copy_files
from ckptctl.ops.verbs import copy_to
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.storage import open_storage
from ckptctl.storage.s3 import S3Storage

TRIALS = int(os.environ.get("CKPTCTL_RACE_TRIALS", "10"))
STEP = 100


def _two_checkpoints(tmp: str) -> dict[str, str]:
    """Two different committed checkpoints of step 100, two shards each (so that the copies
    can interleave file by file), under roots ``a`` and ``b``."""
    out = {}
    for who, fill in (("a", 1.0), ("b", 2.0)):
        one = os.path.join(tmp, f"{who}-one")
        with Checkpointer(one) as ck:
            state = {"model": {f"w{i}": torch.full((96, 512), fill + i) for i in range(4)}, "extra": {"who": who}}
            ck.save(STEP, state).wait()
        two = os.path.join(tmp, who, step_dir(STEP))
        reshard(open_storage(os.path.join(one, step_dir(STEP))), open_storage(two), 2)
        out[who] = two
    return out


def _race(copies: dict[str, Callable[[], object]], seed: int) -> dict[str, str]:
    """Run both copies at once (each after a small random delay); each one's outcome: "ok",
    "refused" (RefusedForSafety) or the text of any other error."""
    rng = random.Random(seed)
    delays = {who: rng.uniform(0.0, 0.02) for who in copies}
    start = threading.Barrier(len(copies))
    outcome: dict[str, str] = {}

    def run(who: str) -> None:
        start.wait()
        threading.Event().wait(delays[who])
        try:
            copies[who]()
            outcome[who] = "ok"
        except RefusedForSafety:
            outcome[who] = "refused"
        except CkptError as e:
            outcome[who] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(who,)) for who in copies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcome


def _judge(step_url: str, sources: dict[str, str], outcome: dict[str, str]) -> str | None:
    """None when the trial ended well: at most one copy succeeded, and then the step verifies
    and commits exactly that copy's source manifest; a copy that failed was refused."""
    winners = [who for who, o in outcome.items() if o == "ok"]
    others = [o for who, o in outcome.items() if who not in winners]
    if len(winners) > 1 or any(o != "refused" for o in others):
        return f"{step_url}: outcomes {outcome}"
    if not winners:
        return None  # both refused: nothing claimed, nothing committed on their word
    report = verify_checkpoint(open_storage(step_url), "checksums")
    if not report.ok:
        return f"{step_url}: {winners[0]} reported success, verify: {report.problems[0]} (outcomes {outcome})"
    there = read_committed_raw(open_storage(step_url)).manifest_raw
    if there != read_committed_raw(open_storage(sources[winners[0]])).manifest_raw:
        return f"{step_url}: {winners[0]} reported success, the step holds the other checkpoint"
    return None


def _trials(sources: dict[str, str], dest: Callable[[int], str], copy: Callable[[str, str], object]) -> Counter:
    failures, counts = [], Counter()
    for i in range(TRIALS):
        step_url = dest(i)
        outcome = _race({who: (lambda src=src: copy(src, step_url)) for who, src in sources.items()}, seed=i)
        counts[tuple(sorted(outcome.values()))] += 1
        problem = _judge(step_url, sources, outcome)
        if problem is not None:
            failures.append(problem)
    assert not failures, f"{len(failures)} of {TRIALS} trials went wrong ({dict(counts)}), e.g.:\n" + "\n".join(failures[:5])
    return counts


def _cp(src: str, dst: str) -> object:
    return copy_to(src, dst)


def test_two_copies_into_one_s3_step_never_break_the_committed_one(tmp_path, atomic_s3_url):
    sources = _two_checkpoints(str(tmp_path))
    counts = _trials(sources, lambda i: f"{atomic_s3_url}/t{i:03d}/{step_dir(STEP)}", _cp)
    print(f"cp race on S3, {TRIALS} trials: {dict(counts)}")


def test_two_multipart_copies_into_one_s3_step_never_break_the_committed_one(tmp_path, atomic_s3_url):
    """The same with every object a multipart upload (completed with ``If-None-Match``)."""
    sources = _two_checkpoints(str(tmp_path))

    def multipart(src: str, dst: str) -> object:
        return copy_checkpoint(open_storage(src), S3Storage(dst, multipart_threshold=0))

    counts = _trials(sources, lambda i: f"{atomic_s3_url}/m{i:03d}/{step_dir(STEP)}", multipart)
    print(f"multipart cp race on S3, {TRIALS} trials: {dict(counts)}")


def test_two_copies_into_one_local_step_never_break_the_committed_one(tmp_path):
    sources = _two_checkpoints(str(tmp_path))
    counts = _trials(sources, lambda i: str(tmp_path / "dst" / f"t{i:03d}" / step_dir(STEP)), _cp)
    print(f"cp race locally, {TRIALS} trials: {dict(counts)}")


# --- tier promotion: a zombie job and its restart promote one step to a shared S3 tier ---------


def test_a_zombie_and_its_restart_promoting_one_step_never_break_it(tmp_path, atomic_s3_url):
    failures, counts = [], Counter()
    trials = max(1, TRIALS // 2)  # each trial builds two tiered Checkpointers
    for i in range(trials):
        remote = f"{atomic_s3_url}/t{i:03d}"
        done: dict[str, object] = {}
        fills = {"zombie": 1.0, "restart": 2.0}

        def job(who: str) -> None:
            local = str(tmp_path / f"t{i:03d}-{who}")
            state = {"model": {f"w{k}": torch.full((64, 512), fills[who] + k) for k in range(4)}, "extra": {"who": who}}
            ck = Checkpointer(tiers=[Tier(local), Tier(remote)], promote_timeout_s=60)
            ck.save(STEP, state).wait()
            done[who] = ck.close()

        _race({who: (lambda who=who: job(who)) for who in fills}, seed=i)
        complete = [who for who, f in done.items() if f]
        counts[tuple(sorted(complete))] += 1
        if len(complete) > 1:
            failures.append(f"{remote}: both jobs say step {STEP} reached S3")
        for who in complete:
            step_url = f"{remote}/{step_dir(STEP)}"
            report = verify_checkpoint(open_storage(step_url), "checksums")
            if not report.ok:
                failures.append(f"{remote}: {who}'s close() said complete; verify: {report.problems[0]}")
                continue
            local = str(tmp_path / f"t{i:03d}-{who}" / step_dir(STEP))
            if read_committed_raw(open_storage(step_url)).manifest_raw != read_committed_raw(open_storage(local)).manifest_raw:
                failures.append(f"{remote}: {who}'s close() said complete; S3 holds the other job's step")
    assert not failures, f"{len(failures)} of {trials} trials went wrong ({dict(counts)}):\n" + "\n".join(failures[:5])
    print(f"tier promotion race, {trials} trials (jobs whose close() said complete): {dict(counts)}")


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    # Two copies and their writer pools share this process; torch's own pool adds nothing here.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --- each rule, deterministically --------------------------------------------------------------


def _one_checkpoint(root: str, fill: float, who: str) -> str:
    with Checkpointer(root) as ck:
        return ck.save(STEP, {"model": {"w": torch.full((64, 256), fill)}, "extra": {"who": who}}).wait()


def test_a_name_holding_other_bytes_is_never_replaced(tmp_path, s3_url):
    """A file another writer left under a shard's name (no marker): the copy is refused for
    safety naming it, the file is left as it was, nothing is committed; locally and on S3."""
    src = _one_checkpoint(str(tmp_path / "src"), 1.0, "src")
    shard = next(n for n in os.listdir(src) if n.endswith(".safetensors"))
    for dst in (str(tmp_path / "dst" / step_dir(STEP)), f"{s3_url}/{step_dir(STEP)}"):
        there = open_storage(dst)
        there.write_atomic(shard, b"another writer's shard")
        with pytest.raises(RefusedForSafety, match="already exists and does not hold this checkpoint's bytes"):
            copy_to(src, dst)
        assert there.read(shard) == b"another writer's shard"
        assert there.stat("COMMITTED") is None and there.stat("manifest.json") is None


def test_a_rerun_on_s3_keeps_what_is_there_and_proven(tmp_path, s3_url):
    """A copy killed before its marker, run again: every file already uploaded is read back,
    proven against the manifest and kept; nothing is uploaded twice."""
    src = _one_checkpoint(str(tmp_path / "src"), 1.0, "src")
    dst = f"{s3_url}/{step_dir(STEP)}"
    first = copy_to(src, dst).result
    open_storage(dst).delete("COMMITTED")  # as if killed just before the marker
    again = copy_to(src, dst).result
    assert again.status == "copied" and again.files_reused == first.files and again.bytes_copied == 0
    assert verify_checkpoint(open_storage(dst), "checksums").ok


def test_the_loser_never_deletes_a_file_the_winner_uses(tmp_path):
    """Two different checkpoints whose shard is byte for byte the same (two jobs that trained
    deterministically from one checkpoint): copy A publishes the shard, copy B finds it holding
    its own bytes and uses it, B commits; A, refused, deletes its files except the shard."""
    a = _one_checkpoint(str(tmp_path / "a"), 1.0, "same")
    b = _one_checkpoint(str(tmp_path / "b"), 1.0, "same")
    ra, rb = read_committed_raw(open_storage(a)), read_committed_raw(open_storage(b))
    assert ra.manifest_raw != rb.manifest_raw and ra.manifest.files == rb.manifest.files  # same shard, two saves
    dst = open_storage(str(tmp_path / "dst" / step_dir(STEP)))
    layout = NativeLayout()
    source_a = layout.copy_source(open_storage(a))
    done = copy_files(Ends(open_storage(a), dst), list(source_a.files))
    assert done.published == [f.name for f in ra.manifest.files]
    copied = copy_checkpoint(open_storage(b), dst)
    assert copied.files_reused == 1 and copied.bytes_copied == 0
    with pytest.raises(RefusedForSafety, match="another writer committed"):
        layout.commit_copy(source_a, dst, done.published)
    assert verify_checkpoint(dst, "checksums").ok
    assert read_committed_raw(dst).manifest_raw == rb.manifest_raw
