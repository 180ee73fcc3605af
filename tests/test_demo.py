"""The README demo: deterministic, honest about what it did, and exact about any difference.

The comparer is tested with crafted curves (a one-ulp difference, a sign of zero, a missing
step), the log format with real files, and the demo itself end to end, twice in a row:
real processes, a real SIGKILL mid-save, real checkpoints on disk.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.demo.curves import KILLED, REFERENCE, RESUMED, Mismatch, bits, compare_curves, judge, read_curve, stitch, write_loss
from ckptctl.demo.job import ToyJob, job_environment
from ckptctl.format.layout import MARKER, step_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _curve(n: int = 60) -> dict[int, float]:
    return {s: 1.0 / (s + 0.37) for s in range(1, n + 1)}


# --- the comparer ---------------------------------------------------------------------------


def test_one_ulp_at_one_step_is_found_and_shown_in_full_precision():
    reference = _curve()
    killed = {s: reference[s] for s in range(1, 41)}
    resumed = {s: reference[s] for s in range(31, 61)}
    resumed[37] = math.nextafter(reference[37], 1.0)  # the smallest possible difference
    resumed[52] = reference[52] + 1.0  # a later, larger one must not hide the first

    mismatch = compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 60)

    assert mismatch == Mismatch(37, RESUMED, reference[37], resumed[37])
    text = str(mismatch)
    assert text.startswith("step 37: resumed job ")
    # Both values, each in a form that round-trips exactly: repr and float.hex.
    for value in (reference[37], resumed[37]):
        assert repr(value) in text and value.hex() in text
    assert f"{reference[37]:.6f}" == f"{resumed[37]:.6f}"  # what the old message printed: equal


def test_identical_curves_pass_and_steps_before_the_resume_are_judged_too():
    reference = _curve()
    killed = {s: reference[s] for s in range(1, 44)}
    resumed = {s: reference[s] for s in range(31, 61)}
    assert compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 60) is None

    killed[12] = math.nextafter(reference[12], 0.0)  # before the checkpoint the job resumed from
    assert compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 60) == Mismatch(12, KILLED, reference[12], killed[12])
    killed[12] = reference[12]
    killed[42] = reference[42] * 2  # trained after the checkpoint, then lost with the kill
    assert compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 60) == Mismatch(42, KILLED, reference[42], killed[42])


def test_zero_signs_differ_bitwise_and_equal_nan_bits_do_not():
    reference = {1: 0.0, 2: float("nan")}
    assert compare_curves(reference, [(RESUMED, {1: -0.0, 2: float("nan")})], 2) == Mismatch(1, RESUMED, 0.0, -0.0)
    assert "-0.0 (-0x0.0p+0" in str(compare_curves(reference, [(RESUMED, {1: -0.0, 2: float("nan")})], 2))
    assert compare_curves(reference, [(RESUMED, {1: 0.0, 2: float("nan")})], 2) is None
    assert bits(0.0) != bits(-0.0)


def test_a_step_no_run_logged_is_a_mismatch_naming_it():
    reference = _curve(10)
    killed = {s: reference[s] for s in range(1, 5)}
    resumed = {s: reference[s] for s in range(6, 11)}
    mismatch = compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 10)
    assert mismatch is not None and mismatch.step == 5 and mismatch.got is None
    assert str(mismatch).startswith("step 5: no loss from the killed job or resumed job")
    extra = compare_curves(reference, [(RESUMED, {**reference, 11: 0.5})], 10)
    assert extra == Mismatch(11, RESUMED, None, 0.5)


# --- the logs -------------------------------------------------------------------------------


def test_logged_losses_come_back_bit_for_bit_and_a_torn_last_line_is_no_loss(tmp_path):
    values = [0.45240992307662964, math.nextafter(0.45240992307662964, 1.0), -0.0, 1e-310, float.fromhex("0x1.fffffep+127")]
    path = tmp_path / "losses.jsonl"
    with open(path, "w") as f:
        for step, value in enumerate(values, 1):
            write_loss(f, step, value)
        f.write('{"step": 6, "loss": 0.1, "bi')  # the job was killed while writing this line
    curve = read_curve(str(path))
    assert sorted(curve) == [1, 2, 3, 4, 5]
    assert [bits(curve[s]) for s in range(1, 6)] == [bits(v) for v in values]
    assert json.loads(path.read_text().splitlines()[0])["loss"] == values[0]  # readable too


def _logs(tmp_path, curves: dict[str, dict[int, float]]) -> dict[str, str]:
    paths = {}
    for name, curve in curves.items():
        paths[name] = str(tmp_path / f"{name.replace(' ', '-')}.jsonl")
        with open(paths[name], "w") as f:
            for step, loss in curve.items():
                write_loss(f, step, loss)
    return paths


def test_the_verdict_is_one_line_naming_the_first_difference_in_full_precision(tmp_path):
    reference = _curve()
    resumed = {s: reference[s] for s in range(31, 61)}
    resumed[33] = math.nextafter(reference[33], 0.0)
    logs = _logs(tmp_path, {REFERENCE: reference, KILLED: {s: reference[s] for s in range(1, 42)}, RESUMED: resumed})
    lines = judge(logs, 60, 40)
    assert "steps 1-41 (it resumed from 30), the resumed job's steps 31-60" in lines[0]
    verdict = lines[-1]
    assert verdict.startswith("verdict: FAIL: ") and "first difference at step 33: resumed job " in verdict
    assert repr(resumed[33]) in verdict and repr(reference[33]) in verdict
    assert resumed[33].hex() in verdict and reference[33].hex() in verdict

    resumed[33] = reference[33]
    logs = _logs(tmp_path, {REFERENCE: reference, KILLED: {s: reference[s] for s in range(1, 42)}, RESUMED: resumed})
    assert judge(logs, 60, 40)[-1] == (f"verdict: PASS: killed mid-save at step 40, resumed from step 30; all 60 losses "
                                       f"equal the uninterrupted run's bit for bit (final loss {reference[60]!r})")


def test_the_resume_point_is_where_the_resumed_log_starts():
    reference = _curve()
    start, runs = stitch({s: reference[s] for s in range(1, 44)}, {s: reference[s] for s in range(31, 61)})
    assert start == 30 and [name for name, _ in runs] == [KILLED, RESUMED]


def test_every_job_gets_one_environment_with_fixed_thread_pools():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "7", "MKL_DYNAMIC": "TRUE", "PYTHONHASHSEED": "random"}
    env = job_environment(1, base)
    assert env == job_environment(1, dict(base))
    assert env["PATH"] == "/usr/bin"
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["OMP_DYNAMIC"], env["MKL_DYNAMIC"]) == ("1", "1", "FALSE", "FALSE")
    assert env["PYTHONHASHSEED"] == "0"
    assert base["OMP_NUM_THREADS"] == "7"  # the caller's mapping is left alone


# --- what the job relies on -----------------------------------------------------------------


def _rng_states() -> tuple:
    import numpy as np

    return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def test_saving_draws_from_no_random_number_generator(tmp_path):
    """A save that drew from a generator after capturing its state would resume a different
    random stream than the job that saved it: dropout would differ from the next step on."""
    job = ToyJob()
    job.step()
    before = _rng_states()
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.prepare(job.state())
        ckpt.save(1, job.state()).wait()
        ckpt.save(2, job.state()).wait()
    after = _rng_states()
    assert torch.equal(before[0], after[0])
    assert before[1] == after[1]
    assert (before[2] == after[2]).all()


# --- the demo, end to end -------------------------------------------------------------------


def _demo(where: str) -> subprocess.CompletedProcess[str]:
    # As the README runs it (scripts/demo.sh ends in exactly this), without the setup step.
    return subprocess.run([sys.executable, "-m", "ckptctl.demo", "--dir", where], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_demo_passes_twice_in_a_row_with_the_same_bits(tmp_path):
    curves = []
    for i in range(2):  # two runs show the bits repeat across processes; a third added ~40 s of CI
        where = str(tmp_path / f"run{i}")
        proc = _demo(where)
        out = proc.stdout
        assert proc.returncode == 0, out + proc.stderr
        lines = out.strip().splitlines()
        assert lines[-1].startswith("verdict: PASS: killed mid-save at step 40, resumed from step 30;"), out
        assert sum(line.startswith("verdict:") for line in lines) == 1
        assert "Traceback" not in out + proc.stderr
        assert f"checkpoints: {where}/checkpoints" in out
        assert "SIGKILL sent to pid" in out and "the job ended: killed by SIGKILL" in out
        assert f"{step_dir(40)}  partial" in out  # what was on disk after the kill

        root = os.path.join(where, "checkpoints")
        for step in (10, 20, 30, 40, 50, 60):  # the resumed job saved 40 again, and committed it
            assert os.path.exists(os.path.join(root, step_dir(step), MARKER)), step
        logs = os.path.join(where, "losses")
        reference = read_curve(os.path.join(logs, "reference.jsonl"))
        killed = read_curve(os.path.join(logs, "killed-job.jsonl"))
        resumed = read_curve(os.path.join(logs, "resumed-job.jsonl"))
        assert sorted(reference) == list(range(1, 61))
        assert min(killed) == 1 and max(killed) >= 40 and min(resumed) == 31 and max(resumed) == 60
        assert compare_curves(reference, [(KILLED, killed), (RESUMED, resumed)], 60) is None
        assert repr(reference[60]) in lines[-1]
        curves.append([bits(reference[s]) for s in range(1, 61)])
    # Not only each demo against itself: every run of the demo computes the same bits.
    assert curves[0] == curves[1]
    assert REFERENCE == "reference"


def test_a_used_directory_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "something").write_text("x")
    proc = _demo(str(tmp_path))
    assert proc.returncode == 2
    assert "is not empty" in proc.stderr
    assert os.listdir(tmp_path) == ["something"]
