"""A real demonstration: train, checkpoint asynchronously, be killed mid-save, resume.

    python -m ckptctl.demo [--root DIR] [--steps 60] [--every 10] [--kill-at 40]

1. A reference run trains a small model for ``--steps`` steps without stopping.
2. The job runs in a child process, saving every ``--every`` steps with ``Checkpointer``; right
   after ``save(kill_at)`` returns (the snapshot is in host memory, the background write has
   just started) the process is killed with SIGKILL.
3. ``ckptctl latest`` logic picks the newest *committed* checkpoint; the half-written one has
   no marker and is ignored.
4. A second child resumes from it and trains to the end. Its losses must equal the reference
   run's, bit for bit: model, AdamW state, LR schedule, data loader position and RNG states
   (dropout) all came back.
"""

from __future__ import annotations

import argparse
import warnings
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
warnings.filterwarnings("ignore", message=".*set_vital.*")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402


class ToyJob:
    """A small but complete training state: model with dropout, AdamW, LR schedule, a
    shuffling stateful data loader, and the step."""

    def __init__(self, seed: int = 0, width: int = 256) -> None:
        # The data set is fixed; ``seed`` varies everything a checkpoint must restore.
        g = torch.Generator().manual_seed(1234)
        torch.manual_seed(seed)
        x = torch.randn(4096, 32, generator=g)
        y = (x @ torch.randn(32, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(4096, generator=g)
        self.model = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=200)
        self.loader = StatefulDataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed + 1))
        self._it = None

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "loader": self.loader}

    def step(self) -> float:
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
        return loss.item()

    def reset_iterator(self) -> None:
        """After a restore, iterate from the loader's restored position."""
        self._it = None


def run_job(root: str, steps: int, every: int, kill_at: int | None, log: str) -> None:
    from ckptctl import Checkpointer

    job = ToyJob()
    ckpt = Checkpointer(root)
    start = ckpt.load_latest(job.state()) or 0
    job.reset_iterator()
    say(f"[job pid {os.getpid()}] " + (f"resumed from step {start}" if start else "starting fresh"))
    with open(log, "a") as f:
        for step in range(start + 1, steps + 1):
            f.write(json.dumps({"step": step, "loss": job.step()}) + "\n")
            f.flush()
            if step == start + 1 and not start:
                ckpt.prepare(job.state())  # a resume already did this in load_latest
            if step % every == 0:
                ckpt.save(step, job.state())
                if step == kill_at:
                    say(f"[job] save({step}) returned after the host snapshot; killing myself with SIGKILL mid-write")
                    os.kill(os.getpid(), signal.SIGKILL)
                say(f"[job] step {step}: saved asynchronously, training continues")
    ckpt.close()


def say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", help="checkpoint root (default: a new temporary directory)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=40)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        run_job(a.root, a.steps, a.every, a.kill_at if a.kill_at > 0 else None, a.log)
        return 0

    root = a.root or tempfile.mkdtemp(prefix="ckptctl-demo-")
    say(f"checkpoint root: {root}")
    say(f"1. reference run: {a.steps} steps without interruption")
    ref = ToyJob()
    reference = [ref.step() for _ in range(a.steps)]

    log = os.path.join(root, "losses.jsonl")
    base = [sys.executable, "-m", "ckptctl.demo", "--job", "--root", root, "--steps", str(a.steps), "--every", str(a.every), "--log", log]
    say(f"2. training job, saving every {a.every} steps, killed during the save at step {a.kill_at}")
    rc = subprocess.call(base + ["--kill-at", str(a.kill_at)])
    say(f"   job exited with {rc} ({'SIGKILL' if rc == -signal.SIGKILL else 'unexpected'})")

    from ckptctl.ops.listing import list_checkpoints
    from ckptctl.storage import open_storage

    say("3. what is on disk (ckptctl ls):")
    for c in list_checkpoints(open_storage(root)):
        say(f"   step {c.step:>4}  {c.status}")
    say("4. resuming: the job loads the newest committed checkpoint")
    rc2 = subprocess.call(base + ["--kill-at", "0"])
    if rc2 != 0:
        say("   resumed job failed")
        return 1
    seen: dict[int, float] = {}
    with open(log) as f:
        for line in f:
            rec = json.loads(line)
            seen[rec["step"]] = rec["loss"]  # a replayed step overwrites the killed run's value
    resumed = [seen[s] for s in range(1, a.steps + 1)]
    same = resumed == reference
    say(f"5. loss curve of the interrupted+resumed run {'==' if same else '!='} uninterrupted run "
        f"(final loss {resumed[-1]:.6f} vs {reference[-1]:.6f})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
