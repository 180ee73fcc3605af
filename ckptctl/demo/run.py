"""The demonstration itself (the parent process): start the reference job, then the job that is
killed mid-save, show what is on disk, resume, and judge (``ckptctl.demo``).

This process never imports torch: it only starts the jobs and reads their logs, so the demo
pays for importing torch once per job, not once more.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from typing import Iterable

import ckptctl.demo
from ckptctl.demo.curves import KILLED, REFERENCE, RESUMED, judge, read_curve
from ckptctl.demo.job import PAUSED, job_environment, run_job


def _job_argv(role: str, root: str, log: str, a: argparse.Namespace, pause_at: int) -> list[str]:
    return [sys.executable, "-m", "ckptctl.demo", "--job", "--role", role, "--dir", root, "--log", log,
            "--steps", str(a.steps), "--every", str(a.every), "--pause-at", str(pause_at), "--threads", str(a.threads)]


def _echo(lines: Iterable[str]) -> None:
    for line in lines:
        print(f"   {line.rstrip()}", flush=True)


def _run(argv: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    _echo(proc.stdout)
    return proc.wait()


def _run_and_kill(argv: list[str], env: dict[str, str], log: str) -> tuple[int, str | None]:
    """Run the job; when it reports its shard written but not yet durable, SIGKILL it.
    Returns its exit status and what was on disk of that shard when the kill was sent."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    paused = None
    for line in proc.stdout:
        if line.startswith(PAUSED) and paused is None:
            step, size = line[len(PAUSED):].split()
            reached = max(read_curve(log), default=0)
            os.kill(proc.pid, signal.SIGKILL)
            paused = f"{int(size):,} bytes"
            _echo([f"[killed job] step {step}: the background writer has the whole shard in a hidden temporary file ({int(size):,} bytes),",
                   "             not yet fsynced or renamed into place; no manifest, no marker",
                   f">>> SIGKILL sent to pid {proc.pid} (it had trained {reached} steps)"])
        else:
            _echo([line])
    return proc.wait(), paused


def _exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def demo(a: argparse.Namespace) -> int:
    from ckptctl.format.layout import MARKER, step_dir
    from ckptctl.ops.listing import list_checkpoints
    from ckptctl.storage import open_storage

    base = a.dir or tempfile.mkdtemp(prefix="ckptctl-demo-")
    if os.path.isdir(base) and os.listdir(base):
        print(f"ckptctl demo: {base} is not empty; give a new or empty directory with --dir", file=sys.stderr)
        return 2
    root, ref_root, logs = os.path.join(base, "checkpoints"), os.path.join(base, "reference"), os.path.join(base, "losses")
    os.makedirs(logs, exist_ok=True)
    log_of = {name: os.path.join(logs, f"{name.replace(' ', '-')}.jsonl") for name in (REFERENCE, KILLED, RESUMED)}
    env = job_environment(a.threads)  # one environment, built once, for every job

    print("ckptctl demo: train, save every", a.every, "steps asynchronously, SIGKILL mid-save, resume from the")
    print("newest committed checkpoint, and compare every step's loss with an uninterrupted run, bit for bit.")
    print(f"  checkpoints: {root}")
    print(f"  reference:   {ref_root}")
    print(f"  losses:      {logs}")
    print("  every job is a new `python -m ckptctl.demo --job` process with the same environment,")
    print(f"  {a.threads} intra-op and {a.threads} inter-op thread(s) and torch.use_deterministic_algorithms(True)")
    print()
    print(f"1. reference: the same job, {a.steps} steps, saving every {a.every}, never interrupted")
    rc = _run(_job_argv(REFERENCE, ref_root, log_of[REFERENCE], a, 0), env)
    if rc != 0:
        print(f"verdict: FAIL: the reference job failed ({_exit_reason(rc)})")
        return 1

    print(f"2. the job, saving every {a.every} steps; killed with SIGKILL while the save of step {a.kill_at} is being written")
    rc, paused = _run_and_kill(_job_argv(KILLED, root, log_of[KILLED], a, a.kill_at), env, log_of[KILLED])
    print(f"   the job ended: {_exit_reason(rc)}")
    if paused is None or rc != -signal.SIGKILL:
        print(f"verdict: FAIL: the job was not killed in the middle of the save of step {a.kill_at}")
        return 1

    print(f"3. on disk ({root}):")
    for c in list_checkpoints(open_storage(root)):
        what = "" if c.status == "committed" else "  <- no marker: not a checkpoint; latest and load_latest skip it"
        print(f"   {c.name}  {c.status}{what}")
    killed_dir = os.path.join(root, step_dir(a.kill_at))
    if os.path.exists(os.path.join(killed_dir, MARKER)):
        print(f"verdict: FAIL: {killed_dir} has a marker although its save was killed")
        return 1
    if os.path.isdir(killed_dir):
        print(f"   {step_dir(a.kill_at)}/ holds: {', '.join(sorted(os.listdir(killed_dir))) or 'nothing'}")

    print("4. resume: a new job process loads the newest committed checkpoint and trains to the end")
    rc = _run(_job_argv(RESUMED, root, log_of[RESUMED], a, 0), env)
    if rc != 0:
        print(f"verdict: FAIL: the resumed job failed ({_exit_reason(rc)})")
        return 1

    lines = judge(log_of, a.steps, a.kill_at)
    print("\n".join(lines))
    return 0 if lines[-1].startswith("verdict: PASS") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptctl.demo", description=ckptctl.demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="a new or empty directory for the checkpoints and logs (default: a new temporary directory)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=40, help="the step whose save is killed (a multiple of --every)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op and inter-op threads of every job")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default=REFERENCE, help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--pause-at", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        run_job(a.role, a.dir, a.steps, a.every, a.pause_at or None, a.log, a.threads)
        return 0
    if a.steps < 1 or a.every < 1 or a.threads < 1:
        p.error("--steps, --every and --threads must be at least 1")
    if a.kill_at % a.every or not a.every < a.kill_at <= a.steps:
        # Above --every: a checkpoint is committed before the killed save, so there is one to resume from.
        p.error(f"--kill-at must be a multiple of --every ({a.every}), above it and at most --steps ({a.steps})")
    return demo(a)
