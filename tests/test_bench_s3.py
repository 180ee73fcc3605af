"""The S3 benchmark runs, at a tiny size, so it cannot rot unnoticed (it once checked shards
against a file checksum whose definition had changed, and nobody ran it for weeks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_s3.py"


def test_bench_s3_runs_and_checks_both_sides(s3_server: str) -> None:
    # The session's moto server (the script would otherwise start its own): a new bucket.
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_server}
    r = subprocess.run([sys.executable, str(SCRIPT), "--size-mib", "6", "--repeat", "1", "--part-mib", "5",
                        "--endpoint-url", s3_server], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for phase in ("upload", "download", "save"):
        assert any(line.startswith(phase) for line in lines), r.stdout
    assert sum("ratio" in line for line in lines) >= 2, r.stdout
