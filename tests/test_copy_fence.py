"""A load never races the device-to-host copies a save left in flight (``overlap_copies``).

With the overlap, ``save()`` returns while copies of parameters still read them on a side
stream; their end is the staging buffer's ``fence``. A roll-back right after a save writes the
parameters on the caller's stream: unless the load first waits for that fence, checkpoint N
mixes old and new values under valid checksums. On the CPU the fence is a recording object
with ``CopyFence``'s interface, installed where the save path leaves its own (the staging
buffer's ``fence``): it notes whether the load had written anything yet when it was waited
for. ``tests/test_gpu.py`` shows the same race with real streams.
"""

from __future__ import annotations

import torch

from ckptctl import Checkpointer


class RecordingFence:
    """Copies still in flight, as far as the Checkpointer can tell: records each wait and what
    the state held at that moment."""

    def __init__(self, watched: torch.Tensor) -> None:
        self.watched = watched
        self.seen: list[torch.Tensor] = []

    def synchronize(self) -> None:
        self.seen.append(self.watched.detach().clone())

    def hold_streams(self) -> None:  # the GPU-side wait; no stream here
        raise AssertionError("a load must wait on the host, before it writes anything")


def test_load_waits_for_copies_left_in_flight_before_it_writes_into_the_state(tmp_path):
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    with Checkpointer(str(tmp_path)) as ckpt:
        path = ckpt.save(1, {"model": model}).wait()
        with torch.no_grad():
            model.weight.fill_(2.0)  # training went on after the save
        fence = RecordingFence(model.weight)
        ckpt._saver.staging.fence = fence  # where save() leaves the fence of its deferred copies
        ckpt.load(path, {"model": model})  # the roll-back
        assert len(fence.seen) == 1, "load did not wait for the copies still reading the state"
        assert torch.equal(fence.seen[0], torch.full((4, 4), 2.0))  # waited before the first write
        assert torch.equal(model.weight.detach(), torch.full((4, 4), 1.0))
        assert ckpt._saver.staging.fence is None  # waited for once, not again at the next load


def test_load_latest_and_close_wait_for_copies_left_in_flight(tmp_path):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"model": model}).wait()
        fence = RecordingFence(model.weight)
        ckpt._saver.staging.fence = fence
        assert ckpt.load_latest({"model": model}, prepare=False) == 1
        assert len(fence.seen) == 1
        closing = RecordingFence(model.weight)
        ckpt._saver.staging.fence = closing
    assert len(closing.seen) == 1  # close() released the buffer only after the copies landed
