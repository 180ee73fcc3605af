"""A process killed (SIGKILL) during a background write never leaves a marker; `latest` and
`load_latest` then pick the previous committed checkpoint.

The kill is real and comes from outside the writer: a child process saves step 1 (committed),
starts saving step 2 (about 64 MiB), and is killed after a delay. Each delay gets its own child,
forked from one server that imported torch once (ten torch imports were most of the runtime).
The delays sweep from "just after save() returned" to "probably after the commit"; for every
delay the invariant must hold, and the sweep must include kills that really landed mid-write (a
partial step 2), or the test proves nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, step_dir
from helpers import cli

# One server process pays for importing torch and ckptctl once; every kill point gets a fresh
# process forked from it (nothing has started a thread or run a tensor op in the server, so the
# fork is clean). The forked child saves step 1, starts saving step 2 (64 MiB) and announces
# its pid; the test kills it from outside with SIGKILL, and the server reaps it and says so.
SERVER = textwrap.dedent(
    """
    import os, sys, time, torch
    from ckptctl import Checkpointer
    print("ready", flush=True)
    for line in sys.stdin:
        root = line.strip()
        pid = os.fork()
        if pid == 0:
            state = {"w": {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}}
            ck = Checkpointer(root)
            ck.save(1, state).wait()
            for t in state["w"].values():
                t.add_(1)
            ck.save(2, state)
            print(f"saving {os.getpid()}", flush=True)
            time.sleep(60)
            os._exit(1)  # never reached: the test kills this process first
        _, status = os.waitpid(pid, 0)
        print(f"reaped {os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}", flush=True)
    """
)


class ForkServer:
    """The server above, driven over its stdin/stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the fork server exited (status {self.proc.poll()})"
        return line.strip()

    def run_and_kill(self, root: str, delay: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(root + "\n")
        self.proc.stdin.flush()
        word, pid = self._line().split()
        assert word == "saving"
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
        assert self._line() == f"reaped {int(signal.SIGKILL)}"

    def close(self) -> None:
        """End the server (at its next read); kill it if a failed test left it waiting on a
        child that was never killed."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
def test_kill_during_background_write_never_leaves_a_marker(tmp_path):
    outcomes = []
    server = ForkServer()
    try:
        for i, delay in enumerate([0.0, 0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 1.0]):
            root = str(tmp_path / f"r{i}")
            server.run_and_kill(root, delay)
            step2 = os.path.join(root, step_dir(2))
            committed = os.path.exists(os.path.join(step2, MARKER))
            outcomes.append(committed)
            r = cli("latest", root)
            assert r.exit_code == 0, r.stderr
            expected = 2 if committed else 1
            assert r.stdout.strip().endswith(step_dir(expected)), (delay, r.stdout)
            if committed:  # a marker means the whole checkpoint is there and intact
                assert cli("verify", step2).exit_code == 0
            target = {"w": {f"t{i}": torch.zeros(1 << 20) for i in range(16)}}
            with Checkpointer(root) as ck:
                assert ck.load_latest(target) == expected
            assert torch.equal(target["w"]["t3"], torch.full((1 << 20,), 3.0 + (expected - 1)))
            ls = {c["step"]: c["status"] for c in cli("ls", root, "--json").json()["checkpoints"]}
            assert ls[1] == "committed" and ls.get(2, "partial") in ("partial", "committed")
    finally:
        server.close()
    assert not all(outcomes), "no kill landed during the write; the test proved nothing"
