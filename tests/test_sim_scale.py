"""``scripts/sim_scale.py``, the scale simulation of saves and loads (issue 14 §1): it passes on
the real code, and fails when loads are planned as the old reader did (every rank reading
every shard header, ranks x tensors bytes per rank)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "sim_scale.py")
SMALL = ["--ranks", "16,32,64", "--tensors", "64", "--verify-tensors", "16", "--repeat", "1"]


def _run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *SMALL, *extra], capture_output=True, text=True, timeout=300)


def test_sim_scale_passes_on_a_small_configuration():
    # Times are noisy on a shared test machine: the counted bytes and files decide here.
    res = _run("--no-time-check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(a) bytes" in res.stdout and "(c) bytes" in res.stdout and "OK:" in res.stdout


def test_sim_scale_fails_when_every_rank_reads_every_header():
    res = _run("--no-time-check", "--read-all-headers")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "a_bytes has a ranks x tensors term" in res.stdout
