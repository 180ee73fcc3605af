"""Library retention never drops a prune (case 8 of the trust issue): a prune deferred to a
newer save is still owed when that save fails (ENOSPC on a full disk), and runs, so a full
disk is freed and the job saves on. Real futures of the retention thread, a real Checkpointer
with a real storage subclass, a real small tmpfs."""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import SaveFailed
from ckptctl.format.layout import step_dir
from ckptctl.ops.retention.background import BackgroundRetention
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints


def _committed(root: str) -> list[int]:
    return [c["step"] for c in cli("ls", root, "--json").json()["checkpoints"] if c["status"] == "committed"]


def _steps(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-"))


def test_a_prune_deferred_to_a_save_that_fails_still_runs(tmp_path):
    """Save 3 commits while save 4 is already queued, so its prune is deferred to save 4's;
    save 4 then fails (ENOSPC). The prune was dropped: on a full disk every later save failed."""
    root = str(tmp_path)
    paths = make_checkpoints(root, [1, 2, 3])
    retention = BackgroundRetention(open_storage(root), keep_last=1, keep_every=None)
    third: Future = Future()
    fourth: Future = Future()
    retention.after(3, third)
    retention.after(4, fourth)  # queued before the third's run could prune
    third.set_result(paths[-1])
    fourth.set_exception(SaveFailed(f"save of step 4 to {ckpt_dir(root, 4)} failed: [Errno 28] disk full"))
    retention.close()
    assert _steps(root) == [3]


def test_a_checkpointer_whose_deferred_prune_meets_a_full_disk_still_prunes(tmp_path):
    """The same through a real Checkpointer: step 3's post-commit check is held at a gate until
    step 4 is queued (so step 3's prune waits for step 4's), and step 4's shard gets ENOSPC from
    a real storage subclass. The prune owed since step 3 runs all the same."""
    import errno
    import threading

    from ckptctl.format.layout import MARKER
    from ckptctl.storage.local import LocalStorage

    class GatedFullDisk(LocalStorage):
        gate = threading.Event()

        def list(self, prefix: str = ""):
            # Only the post-commit check of step 3 lists it once its marker is there.
            if self.url.endswith(step_dir(3)) and os.path.exists(os.path.join(self.local_path(), MARKER)):
                self.gate.wait(120)  # a guard against a hang, not a timing assumption
            return super().list(prefix)

        def open_writer(self, key: str):
            if self.url.endswith(step_dir(4)):
                raise OSError(errno.ENOSPC, "No space left on device", self.local_path(key))
            return super().open_writer(key)

    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    state = {"w": torch.ones(64)}
    with Checkpointer(root, keep_last=1, storage=GatedFullDisk(root)) as ck:
        third = ck.save(3, state)
        fourth = ck.save(4, state)
        GatedFullDisk.gate.set()
        third.wait()
        with pytest.raises(SaveFailed, match="No space left"):
            fourth.wait()
    assert _committed(root) == [3]


def test_a_full_disk_recovers_under_library_retention(tmp_path):
    """A real Checkpointer on a small tmpfs: a save that cannot fit fails, the prune it owes
    runs anyway, and the job saves on."""
    from helpers import tmpfs

    one = {"w": torch.ones(256 << 10)}  # 1 MiB
    with tmpfs("5m") as mountpoint:
        root = os.path.join(mountpoint, "ckpt")
        with Checkpointer(root, keep_last=1) as ck:
            ck.save(1, one).wait()
            ck.save(2, one).wait()
            with pytest.raises(SaveFailed):
                ck.save(3, {"w": torch.ones(1 << 20)}).wait()  # 4 MiB beside 1 or 2 MiB: does not fit
        assert _committed(root) == [2]
        with Checkpointer(root, keep_last=1) as ck:
            ck.save(4, {"w": torch.ones(3 << 18)}).wait()  # 3 MiB: fits once step 1 is gone
        assert _committed(root) == [4]
