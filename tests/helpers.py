"""Shared test helpers: make real checkpoints, run the real CLI."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator

import pytest
import torch
from typer.testing import CliRunner

from ckptctl import Checkpointer
from ckptctl.cli.app import app
from ckptctl.format.layout import step_dir


def make_checkpoints(root: str, steps, *, size: int = 1000, tensors: int = 3) -> list[str]:
    """Commit one small checkpoint per step; returns their paths."""
    paths = []
    with Checkpointer(root) as ckpt:
        for s in steps:
            state = {"model": {f"w{i}": torch.full((size,), float(s * 10 + i)) for i in range(tensors)}, "extra": {"step": s}}
            paths.append(ckpt.save(s, state).wait())
    return paths


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def cli(*args: str) -> Result:
    """Run the CLI in-process (fast); stdout and stderr kept apart."""
    r = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


def cli_subprocess(*args: str, env: dict | None = None, timeout: float = 120) -> Result:
    """Run the installed console entry point in a real process."""
    p = subprocess.run([sys.executable, "-m", "ckptctl.cli", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def dead_pid() -> int:
    """The pid of a process that has exited, as a SIGKILLed writer's temporaries and locks
    carry. Never a made-up number: any fixed pid may be alive on the machine running the tests
    (CI's was), and a live writer's temporary is rightly left alone."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def ckpt_dir(root: str, step: int) -> str:
    return os.path.join(root, step_dir(step))


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[str]:
    """A real, small filesystem to fill up (a tmpfs of ``size``); skips the test without root."""
    mountpoint = tempfile.mkdtemp(prefix="ckptctl-tmpfs-")
    try:
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mountpoint],
                check=True, capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as err:
            pytest.skip(f"cannot mount a small tmpfs to fill (needs root/CAP_SYS_ADMIN): {err}")
        try:
            yield mountpoint
        finally:
            subprocess.run(["umount", mountpoint], check=True)
    finally:
        os.rmdir(mountpoint)
