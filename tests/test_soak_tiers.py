"""The soak of tiered checkpointing under faults (issue 31), in its short version: one seed,
a few faults, a relaunch, the checks of ``scripts/soak_tiers.py`` (resume bitwise from the
newest step whole on the copies that exist, S3's committed steps unchanged, bounded node disks
and store keys, no dead tier thread while saves go on). ``--minutes 10`` is the long one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak_tiers.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="the soak mounts a tmpfs per node and resets sockets (ss -K): root")
def test_a_short_soak_passes(tmp_path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "0.2", "--seed", "7", "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=600)
    report = r.stdout[r.stdout.find("soak_tiers:"):]
    assert r.returncode == 0, report + r.stderr[-3000:]
    assert "PASSED (seed 7" in report
    for line in ("faults:", "relaunches: ", "saves: ", "steps committed: node0 ", "max store keys: "):
        assert line in report, report
