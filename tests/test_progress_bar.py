"""On a terminal, copies and verifications draw a bar with a total, %, rate and ETA, in the
units of the rest of the output (KiB/MiB/GiB); --quiet and a non-terminal draw nothing.
Runs the real command with its stderr on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

import pytest
from helpers import ckpt_dir, make_checkpoints


def run_on_tty(*args: str) -> tuple[int, str, str]:
    """(exit status, stdout, what the terminal on stderr showed)."""
    master, slave = os.openpty()
    # A real terminal has a size; a fresh pty is 0x0, and tqdm would draw a bar 0 columns wide.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", *args], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode() if proc.stdout else ""
    proc.wait(timeout=120)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


# "sync:  40%|████      | 9.2M/22.9MiB [00:01<00:02, 6.1MiB/s]": %, done/total, elapsed<ETA, rate
BAR = re.compile(r"(\d+)%\|[^|]*\| *[\d.]+[KMGT]?/([\d.]+)([KMGT]?)iB \[\d\d:\d\d<[^,\]]*, *[^\]]*iB/s\]")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("bars") / "root")
    make_checkpoints(root, [1, 2], size=1_000_000)  # 12 MB each
    return root


@pytest.mark.parametrize("verb", ["sync", "cp", "verify"])
def test_a_bar_with_total_percent_rate_and_eta(root: str, tmp_path, verb: str) -> None:
    args = {"sync": ["sync", root, str(tmp_path / "mirror")],
            "cp": ["cp", ckpt_dir(root, 2), str(tmp_path / "copy")],
            "verify": ["verify", ckpt_dir(root, 2)]}[verb]
    code, _out, shown = run_on_tty(*args)
    assert code == 0, shown
    bars = BAR.findall(shown)
    assert bars, f"no bar with a total on the terminal:\n{shown!r}"
    total_mib = {"sync": 2 * 11.4, "cp": 11.4, "verify": 11.4}[verb]
    pct, total, unit = bars[-1]
    assert 0 <= int(pct) <= 100 and unit == "M" and abs(float(total) - total_mib) < 1.0, bars[-1]


def test_quiet_and_no_terminal_draw_nothing(root: str, tmp_path) -> None:
    # --quiet on success: no bar and no summary on the terminal; the copy's path (data) stays.
    code, out, shown = run_on_tty("cp", ckpt_dir(root, 1), str(tmp_path / "q"), "--quiet")
    assert code == 0 and shown == "" and out.strip() == str(tmp_path / "q" / "step-0000000001"), (out, shown)
    p = subprocess.run([sys.executable, "-m", "ckptctl.cli", "sync", root, str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "%|" not in p.stderr and "\r" not in p.stderr
