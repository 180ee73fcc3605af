"""The demo's training job, one child process per run (``python -m ckptctl.demo --job``): a small
but complete training state, the environment and runtime settings that make every run compute
the same bits, and the storage that holds the killed job's save mid-write.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ckptctl.demo.curves import write_loss

if TYPE_CHECKING:
    from ckptctl.storage.local import LocalStorage

PAUSED = "@ckptctl-demo paused "  # the job's line telling the parent to kill it now


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


# --- the job -------------------------------------------------------------------------------

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
                announce(f"{PAUSED}{pause_at} {size}")
                threading.Event().wait()  # never set: only the SIGKILL ends this thread

            # Whichever of them the save path calls to make the shard durable; if it called
            # none, the parent sees no pause and says the kill did not land mid-save.
            for name in ("commit", "commit_if_absent", "publish"):
                if hasattr(writer, name):
                    setattr(writer, name, pause)
            return writer

    return PausingStorage(root)


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
