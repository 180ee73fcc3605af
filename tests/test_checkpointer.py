"""Round trip and resume through the public Checkpointer API, on real files."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from ckptctl import Checkpointer
from ckptctl.demo.job import ToyJob
from ckptctl.errors import RefusedForSafety, SaveFailed, StateError
from ckptctl.format.layout import MARKER, step_dir


def _snapshot(job: ToyJob) -> dict:
    return copy.deepcopy({
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "loader": job.loader.state_dict(),
    })


def test_round_trip_is_bitwise_and_training_resumes_identically(tmp_path):
    ref = ToyJob()
    losses_ref = [ref.step() for _ in range(25)]

    job = ToyJob()
    for _ in range(10):
        job.step()
    with Checkpointer(str(tmp_path)) as ckpt:
        path = ckpt.save(10, job.state()).wait()
    assert path.endswith(step_dir(10))
    at_save = _snapshot(job)
    after_save = [job.step() for _ in range(15)]

    resumed = ToyJob(seed=123)  # different init, data order and RNG: all must be overwritten
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.load_latest(resumed.state()) == 10
    resumed.reset_iterator()
    assert _deep_equal(_snapshot(resumed), at_save)
    losses = [resumed.step() for _ in range(15)]
    assert losses == after_save == losses_ref[10:]


def _deep_equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_deep_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_deep_equal, x, y))
    return x == y


def test_plain_tensors_nested_json_and_tuples_round_trip(tmp_path):
    state = {
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "extra": {"epoch": 3, "name": "run-7", "betas": (0.9, 0.95), "nan": math.inf, "ids": {1: "a"}, "mask": torch.tensor([True, False])},
        "seen": [1, 2, 3],
    }
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        target = {"t": torch.zeros(2, 3, dtype=torch.bfloat16), "extra": {}, "seen": None}
        t_before = target["t"]
        assert ckpt.load_latest(target) == 1
    assert target["t"] is t_before and torch.equal(target["t"], state["t"])  # in place
    assert target["extra"]["betas"] == (0.9, 0.95) and target["extra"]["ids"] == {1: "a"}
    assert target["extra"]["nan"] == math.inf and target["seen"] == [1, 2, 3]
    assert torch.equal(target["extra"]["mask"], state["extra"]["mask"])


def test_rng_states_are_restored(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"x": torch.zeros(1)}).wait()
        expected = (torch.rand(3), random.random(), np.random.rand())
        torch.manual_seed(9), random.seed(9), np.random.seed(9)
        ckpt.load_latest({"x": torch.zeros(1)})
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_non_json_value_is_refused_naming_the_key(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(StateError, match="extra/fn"):
            ckpt.save(1, {"extra": {"fn": object()}})


def test_committed_step_is_never_overwritten(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(5, {"x": torch.ones(3)}).wait()
        with pytest.raises(RefusedForSafety, match="already committed"):
            ckpt.save(5, {"x": torch.zeros(3)})


def test_saves_are_serialised_and_each_commits(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        handles = [ckpt.save(s, {"x": torch.full((1000,), float(s))}) for s in range(1, 6)]
        ckpt.wait()
    for h in handles:
        assert h.done() and os.path.exists(os.path.join(h.url, MARKER))
    with Checkpointer(str(tmp_path)) as ckpt:
        target = {"x": torch.zeros(1000)}
        ckpt.load(os.path.join(str(tmp_path), step_dir(3)), target)
        assert torch.equal(target["x"], torch.full((1000,), 3.0))


def test_failed_background_write_leaves_no_marker_and_raises_everywhere(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    # A regular file where the step directory must go: the background write fails for real.
    (root / step_dir(2)).write_text("in the way")
    ckpt = Checkpointer(str(root))
    ckpt.save(1, {"x": torch.ones(4)}).wait()
    h = ckpt.save(2, {"x": torch.ones(4)})
    with pytest.raises(SaveFailed, match="step 2"):
        h.wait()
    ckpt.save(3, {"x": torch.ones(4)}).wait()  # already seen by wait(): not raised again
    (root / step_dir(5)).write_text("in the way")
    ckpt.save(5, {"x": torch.ones(4)})
    with pytest.raises(SaveFailed, match="step 5"):
        ckpt.close()
    assert not (root / step_dir(2) / MARKER).exists()


def test_unseen_failure_is_raised_by_the_next_save(tmp_path):
    (tmp_path / step_dir(1)).write_text("in the way")
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"x": torch.ones(2)})
    with pytest.raises(SaveFailed, match="step 1"):
        ckpt.save(2, {"x": torch.ones(2)})
    ckpt.save(3, {"x": torch.ones(2)}).wait()
    ckpt.close()


def test_strict_load_names_the_mismatch_and_non_strict_skips_it(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"model": nn.Linear(4, 3)}).wait()
        with pytest.raises(StateError, match="weight"):
            ckpt.load_latest({"model": nn.Linear(4, 2)})
        other = nn.Linear(4, 2)
        bias_before = other.bias.detach().clone()
        assert ckpt.load_latest({"model": other}, strict=False) == 1
        assert torch.equal(other.bias, bias_before)  # skipped, untouched


def test_load_latest_returns_none_on_an_empty_root(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.load_latest({"x": torch.zeros(1)}) is None


def _adamw_losses(tmp_path, *, save_at_0: bool, reload: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(str(tmp_path)) as ckpt:
        if save_at_0:
            ckpt.save(0, {"model": model, "optimizer": opt}).wait()
        if reload:  # a fresh job resumes from the step-0 checkpoint
            torch.manual_seed(1)
            model = nn.Linear(4, 4)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            assert ckpt.load_latest({"model": model, "optimizer": opt}) == 0
            assert not opt.state
    losses = []
    for i in range(5):
        loss = model(torch.full((2, 4), float(i))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_saving_before_the_first_optimizer_step_leaves_training_unchanged(tmp_path):
    # torch's state_dict helper would step a fresh AdamW once (lr 0) to create its state,
    # shifting Adam's bias correction: the losses after a step-0 save used to differ.
    plain = _adamw_losses(tmp_path / "a", save_at_0=False)
    assert _adamw_losses(tmp_path / "b", save_at_0=True) == plain
    assert _adamw_losses(tmp_path / "c", save_at_0=True, reload=True) == plain


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
@pytest.mark.parametrize("huge_pages", ["", "0", "1"])  # unset is the default: ordinary pages
def test_prepare_faults_the_staging_buffer_in_before_the_first_snapshot(monkeypatch, huge_pages):
    from ckptctl.save.shard_layout import make_layout, signature_of
    from ckptctl.save.staging import StagingBuffer
    from ckptctl.state.capture import capture

    monkeypatch.setenv("CKPTCTL_HUGEPAGES", huge_pages)
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so every buffer is fresh memory.
    state = {"w": torch.ones(48 << 20, dtype=torch.uint8), "v": torch.ones(16 << 20, dtype=torch.uint8)}
    captured = capture(state, with_rng=False)
    plan = make_layout(captured.tensors, signature_of(captured.tensors), rank=0, world_size=1)
    assert plan.nbytes == 64 << 20

    lazy = StagingBuffer()
    before = _rss()
    lazy.reserve(plan)  # allocated, not touched: the first snapshot would fault it in
    assert _rss() - before < 16 << 20

    staged = StagingBuffer()
    before = _rss()
    assert staged.prepare(plan) and staged.held
    assert not staged.prepare(plan)  # already under way
    buf = staged.reserve(plan)  # waits for the background thread
    assert _rss() - before >= 60 << 20
    assert staged.snapshot(plan, captured.tensors).data_ptr() == buf.data_ptr()  # the one buffer, reused
    assert bool((buf[: 64 << 20] == 1).all())


def test_prepare_waits_for_the_first_step_and_load_latest_prepares(tmp_path):
    job = ToyJob()
    with Checkpointer(str(tmp_path)) as ckpt:
        assert not ckpt.prepare(job.state())  # the optimizer has no state yet: size unknown
        assert not ckpt.staging_held
        job.step()
        assert ckpt.prepare(job.state()) and ckpt.staging_held
        job.step()
        ckpt.save(2, job.state()).wait()
        at_save = _snapshot(job)

    for prepare in (True, False):
        fresh = ToyJob(seed=1)
        with Checkpointer(str(tmp_path)) as ckpt:
            assert ckpt.load_latest(fresh.state(), prepare=prepare) == 2
            assert ckpt.staging_held == prepare
        assert _deep_equal(_snapshot(fresh), at_save)


def test_full_disk_fails_the_save_cleanly_and_the_last_good_checkpoint_stays(tmp_path):
    from helpers import cli, tmpfs

    small = {"w": torch.ones(256 << 10)}  # 1 MiB
    with tmpfs("6m") as mountpoint:
        root = os.path.join(mountpoint, "ckpt")
        with Checkpointer(root) as ckpt:
            ckpt.save(1, small).wait()
            with pytest.raises(SaveFailed, match="disk full") as info:
                ckpt.save(2, {"w": torch.ones(2 << 20)}).wait()  # 8 MiB: does not fit
            assert "rank-00000-of-00001.safetensors" in str(info.value)  # names the file at fault
            assert not os.path.exists(os.path.join(root, step_dir(2), MARKER))
            assert cli("latest", root).stdout.strip().endswith(step_dir(1))
            assert cli("verify", os.path.join(root, step_dir(1))).exit_code == 0
            # The failed write took its partial file back; prune clears the empty step directory
            # (no marker, idle), and the job saves on.
            r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes")
            assert r.exit_code == 0, r.stderr
            assert not os.path.exists(os.path.join(root, step_dir(2)))
            ckpt.save(3, small).wait()
        assert cli("latest", root).stdout.strip().endswith(step_dir(3))


def test_shard_hashed_while_written_matches_its_checksums(tmp_path):
    # On POSIX the writer hashes the data section piece by piece as it writes it, then writes
    # the header over a placeholder: tensors that straddle pieces, empty tensors and a tensor
    # bigger than a piece must all come back with checksums that verify and bytes that load.
    from helpers import cli

    from ckptctl.format.layout import MANIFEST
    from ckptctl.settings import STREAM_PIECE

    g = torch.Generator().manual_seed(5)
    piece = STREAM_PIECE // 4  # float32 elements per piece
    state = {"w": {
        "a": torch.randn(piece // 3, generator=g),
        "empty": torch.empty(0),
        "b": torch.randn(2 * piece + 17, generator=g),
        "c": torch.randn(5, generator=g),
        "empty2": torch.empty(0, 3),
    }}
    with Checkpointer(str(tmp_path)) as ckpt:
        path = ckpt.save(1, state).wait()
        assert os.path.exists(os.path.join(str(tmp_path), step_dir(1), MANIFEST))
        assert cli("verify", path).exit_code == 0
        target = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}}
        ckpt.load(path, target)
    assert _deep_equal(target, state)
    # A flipped byte in the last piece of "b" is caught by its chunk checksum.
    shard = os.path.join(str(tmp_path), step_dir(1), "rank-00000-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-40, os.SEEK_END)
        byte = f.read(1)
        f.seek(-40, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    r = cli("verify", path)
    assert r.exit_code != 0 and "w/b" in (r.stdout + r.stderr)
