"""A real demonstration: train, checkpoint asynchronously, be killed mid-save, resume.

    python -m ckptctl.demo [--dir DIR] [--steps 60] [--every 10] [--kill-at 40] [--threads 1]

1. A reference job trains a small model for ``--steps`` steps, saving every ``--every`` steps,
   and is never interrupted.
2. The same job runs again, saving every ``--every`` steps with ``Checkpointer`` (``save``
   returns after the host snapshot; a background thread writes the shard). While the shard of
   step ``--kill-at`` is being written, this process kills the job with SIGKILL.
3. The checkpoints on disk are listed: the half-written one has no marker, so it is no
   checkpoint.
4. A new job process resumes from the newest *committed* checkpoint and trains to the end.
5. Every step's loss is compared bit for bit with the reference: every step the killed job
   trained (those after the checkpoint too, lost with the kill) and every step the resumed job
   trained. Model, AdamW state, LR schedule, data loader position and RNG states (dropout) must
   all have come back. The last line is the verdict; exit status 0 PASS, 1 FAIL, 2 usage.

Bit-identical curves need runs that compute identically, so every run (the reference too) is a
fresh process started the same way (``python -m ckptctl.demo --job``, one environment built
once) with fixed thread counts, ``torch.use_deterministic_algorithms(True)``, explicitly seeded
generators and no loader workers. Losses are logged and compared as raw float64 bits; a
difference names the first step that differs with both values in full precision.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from ckptctl.storage.local import LocalStorage

# The orchestrating process never imports torch: it only starts the jobs and reads their logs,
# so the demo pays for importing torch once per job, not once more.

REFERENCE, KILLED, RESUMED = "reference", "killed job", "resumed job"
_PAUSED = "@ckptctl-demo paused "  # the job's line telling this process to kill it now


class ToyJob:
    """A small but complete training state: model with dropout, AdamW, LR schedule, a
    shuffling stateful data loader, and the step."""

    def __init__(self, seed: int = 0, width: int = 256) -> None:
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset

        from torchdata.stateful_dataloader import StatefulDataLoader

        # The data set is fixed; ``seed`` varies everything a checkpoint must restore. Every
        # random draw comes from a generator seeded here: the data from ``g``, the initial
        # weights and dropout from the global torch generator, the shuffle from the loader's own.
        g = torch.Generator().manual_seed(1234)
        torch.manual_seed(seed)
        x = torch.randn(4096, 32, generator=g)
        y = (x @ torch.randn(32, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(4096, generator=g)
        self.model = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=200)
        # No workers: worker processes would seed themselves from a base seed and add an
        # ordering between processes that the demo does not need.
        self.loader = StatefulDataLoader(
            TensorDataset(x, y), batch_size=64, shuffle=True, num_workers=0,
            generator=torch.Generator().manual_seed(seed + 1),
        )
        self._it: Any = None

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "loader": self.loader}

    def step(self) -> float:
        from torch import nn

        if self._it is None:
            self._it = iter(self.loader)
        try:
            xb, yb = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            xb, yb = next(self._it)
        self.model.train()
        loss = nn.functional.mse_loss(self.model(xb).squeeze(1), yb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.item())

    def reset_iterator(self) -> None:
        """After a restore, iterate from the loader's restored position."""
        self._it = None


# --- one environment for every job ----------------------------------------------------------


def job_environment(threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every job of one demo runs in, built once and passed to each of them.

    Thread pools are fixed before torch is imported (OpenMP and MKL read these at start-up):
    a floating-point sum split over a different number of threads, or over as many threads as
    a dynamic runtime thinks the machine can spare right now, rounds differently."""
    env = dict(os.environ if base is None else base)
    n = str(threads)
    env.update({
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "OMP_DYNAMIC": "FALSE",
        "MKL_DYNAMIC": "FALSE",
        # MKL's reproducibility mode: the same code path and reduction order in every run.
        "MKL_CBWR": "AUTO,STRICT",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
        # Required by use_deterministic_algorithms should the job ever run cuBLAS.
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    })
    return env


def deterministic_runtime(threads: int) -> None:
    """Fix torch's thread pools and forbid nondeterministic kernels; first thing in a job."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# --- the job (a child process) --------------------------------------------------------------

_out_lock = threading.Lock()


def say(msg: str) -> None:
    # Two threads of a job print (training, and the writer at the pause): one write per line.
    with _out_lock:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


def pausing_storage(root: str, pause_at: int | None, announce: Callable[[str], None]) -> "LocalStorage":
    """The job's local storage. With ``pause_at``, the writer of that step's shard stops just
    before the shard is made durable: every byte is in a hidden temporary file, not fsynced, not
    renamed into place, no manifest, no marker. It tells the parent, which kills the job.

    This only decides *when* the kill lands (mid-save, every time, instead of by luck); the
    kill itself is a real SIGKILL from another process. Without ``pause_at`` (the reference and
    the resumed job) every write goes straight through."""
    from ckptctl.format.layout import SHARD_SUFFIX, step_dir
    from ckptctl.storage.local import LocalStorage, LocalWriter

    class PausingStorage(LocalStorage):
        def open_writer(self, key: str) -> LocalWriter:
            writer = super().open_writer(key)
            path = self.local_path(key)
            if pause_at is None or not (path.endswith(SHARD_SUFFIX) and os.path.basename(os.path.dirname(path)) == step_dir(pause_at)):
                return writer

            def pause(*args: object, **kwargs: object) -> None:
                # What is in the step's directory now: the shard's hidden temporary file.
                with os.scandir(os.path.dirname(path)) as entries:
                    size = sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
                announce(f"{_PAUSED}{pause_at} {size}")
                threading.Event().wait()  # never set: only the SIGKILL ends this thread

            # Whichever of them the save path calls to make the shard durable; if it called
            # none, the parent sees no pause and says the kill did not land mid-save.
            for name in ("commit", "commit_if_absent", "publish"):
                if hasattr(writer, name):
                    setattr(writer, name, pause)
            return writer

    return PausingStorage(root)


def write_loss(f: Any, step: int, loss: float) -> None:
    """One log line per step; ``bits`` is the exact float64, ``loss`` is for people."""
    f.write(json.dumps({"step": step, "loss": loss, "bits": struct.pack(">d", loss).hex()}) + "\n")
    f.flush()


def run_job(role: str, root: str, steps: int, every: int, pause_at: int | None, log: str, threads: int) -> None:
    deterministic_runtime(threads)
    # torchdata calls a deprecated torch API on every new iterator; not ours, and not news.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    from ckptctl import Checkpointer

    job = ToyJob()
    ckpt = Checkpointer(root, storage=pausing_storage(root, pause_at, say))
    start = ckpt.load_latest(job.state()) or 0
    job.reset_iterator()
    say(f"[{role} pid {os.getpid()}] " + (f"resumed from step {start}" if start else "starting fresh"))
    with open(log, "a") as f:
        for step in range(start + 1, steps + 1):
            write_loss(f, step, job.step())
            if step == start + 1 and not start:
                ckpt.prepare(job.state())  # a resume already did this in load_latest
            if step % every == 0:
                t = time.perf_counter()
                ckpt.save(step, job.state())
                ms = (time.perf_counter() - t) * 1e3
                say(f"[{role}] step {step:>3}: save() returned after {ms:.1f} ms (host snapshot); the write goes on in the background")
    ckpt.close()  # waits for the last write
    say(f"[{role}] step {steps}: done, every save committed")


# --- comparing curves -----------------------------------------------------------------------


def bits(x: float) -> bytes:
    """The float64's raw bytes: equal bits, not ``==`` (which calls 0.0 and -0.0 equal and a
    NaN unequal to itself)."""
    return struct.pack(">d", x)


def full(x: float) -> str:
    """A value in full precision: shortest round-trip repr, and its exact hex form."""
    return f"{x!r} ({x.hex()}, bits {bits(x).hex()})"


@dataclass(frozen=True)
class Mismatch:
    """The first step at which a run's loss is not the reference's, bit for bit."""

    step: int
    run: str
    expected: float | None  # None: the reference has no such step
    got: float | None  # None: the run has no such step

    def __str__(self) -> str:
        if self.got is None:
            return f"step {self.step}: no loss from the {self.run} (reference {full(self.expected)})"  # type: ignore[arg-type]
        if self.expected is None:
            return f"step {self.step}: the reference has no loss, the {self.run} has {full(self.got)}"
        return f"step {self.step}: {self.run} {full(self.got)} != reference {full(self.expected)}"


def compare_curves(reference: Mapping[int, float], runs: Sequence[tuple[str, Mapping[int, float]]], steps: int) -> Mismatch | None:
    """None when every step 1..``steps`` has a loss from some run, and every loss any run
    logged equals the reference's bit for bit; else the mismatch at the lowest step (first in
    ``runs`` order on a tie)."""
    found: list[Mismatch] = []
    for step in range(1, steps + 1):
        if not any(step in curve for _, curve in runs):
            found.append(Mismatch(step, " or ".join(name for name, _ in runs), reference.get(step), None))
    for name, curve in runs:
        for step, got in curve.items():
            expected = reference.get(step)
            if expected is None or bits(got) != bits(expected):
                found.append(Mismatch(step, name, expected, got))
    if not found:
        return None
    order = {name: i for i, (name, _) in enumerate(runs)}
    return min(found, key=lambda m: (m.step, order.get(m.run, -1)))


def read_curve(path: str) -> dict[int, float]:
    """Step -> loss from a job's log. A last line without its newline (the job was killed
    while writing it) is not a loss."""
    curve: dict[int, float] = {}
    if not os.path.exists(path):
        return curve
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            rec = json.loads(line)
            curve[int(rec["step"])] = struct.unpack(">d", bytes.fromhex(rec["bits"]))[0]
    return curve


def stitch(killed: Mapping[int, float], resumed: Mapping[int, float]) -> tuple[int, list[tuple[str, dict[int, float]]]]:
    """The step the resumed job started after, and the curve to judge: the killed job's steps
    up to that step, the resumed job's from there on. The killed job's steps after it (trained,
    then lost with the kill) are judged too: the same computation must give the same bits."""
    start = min(resumed) - 1 if resumed else max(killed, default=0)
    return start, [(KILLED, dict(killed)), (RESUMED, dict(resumed))]


# --- the demonstration (the parent process) -------------------------------------------------


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
        if line.startswith(_PAUSED) and paused is None:
            step, size = line[len(_PAUSED):].split()
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
    print(f"  every job is a new `python -m ckptctl.demo --job` process with the same environment,")
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


def judge(log_of: Mapping[str, str], steps: int, kill_at: int) -> list[str]:
    """Step 5 from the three jobs' logs: what was compared, then the one-line verdict (last)."""
    reference = read_curve(log_of[REFERENCE])
    start, runs = stitch(read_curve(log_of[KILLED]), read_curve(log_of[RESUMED]))
    last_killed = max(runs[0][1], default=0)
    lines = [f"5. compare every loss with the reference's, bit for bit (float64): the killed job's steps 1-{last_killed}"
             f" (it resumed from {start}), the resumed job's steps {start + 1}-{steps}"]
    mismatch = compare_curves(reference, runs, steps)
    if mismatch is not None:
        lines.append(f"   logs: {os.path.dirname(log_of[REFERENCE])}")
        lines.append(f"verdict: FAIL: the interrupted run is not the uninterrupted one; first difference at {mismatch}")
    else:
        lines.append(f"verdict: PASS: killed mid-save at step {kill_at}, resumed from step {start}; all {steps} losses equal "
                     f"the uninterrupted run's bit for bit (final loss {reference[steps]!r})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptctl.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
