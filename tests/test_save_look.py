"""save()'s look at the step's marker (is it committed already? then refuse at once) runs
beside the snapshot, not before it: on object storage the look is a round trip, and the
training thread waited for it in series with the copy on every save."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import RefusedForSafety
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.storage.local import LocalStorage


def _roots() -> tuple[type[LocalStorage], threading.Event, list[bool]]:
    """A local root whose marker look waits (up to 5 s) for the save to capture the state,
    and records whether it saw that; and the event a stateful object of the state sets."""
    capturing, overlapped = threading.Event(), []

    class LookWaitsForCapture(LocalStorage):
        def stat(self, key: str):  # type: ignore[no-untyped-def]
            if key == MARKER:
                overlapped.append(capturing.wait(5))
            return super().stat(key)

    return LookWaitsForCapture, capturing, overlapped


class _Probe:
    """A stateful object of the state: capture asks it for its state_dict."""

    def __init__(self, capturing: threading.Event) -> None:
        self.capturing = capturing

    def state_dict(self) -> dict:
        self.capturing.set()
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_the_marker_look_runs_beside_the_snapshot(tmp_path):
    root_type, capturing, overlapped = _roots()
    with Checkpointer(str(tmp_path), storage=root_type(str(tmp_path))) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000), "probe": _Probe(capturing)}).wait()
    assert overlapped[0] is True  # save()'s look (the commit's own look comes later); looked first, then copied: False, 5 s later


def test_a_committed_step_is_still_refused_before_save_returns(tmp_path):
    root_type, capturing, overlapped = _roots()
    with Checkpointer(str(tmp_path), storage=root_type(str(tmp_path))) as ckpt:
        ckpt.save(2, {"w": torch.ones(1000), "probe": _Probe(capturing)}).wait()
        with pytest.raises(RefusedForSafety, match="already committed"):
            ckpt.save(2, {"w": torch.zeros(1000), "probe": _Probe(capturing)})
        ckpt.save(3, {"w": torch.full((1000,), 3.0), "probe": _Probe(capturing)}).wait()  # the next save is unharmed
        got = {"w": torch.empty(1000), "probe": _Probe(capturing)}
        assert ckpt.load(str(tmp_path / step_dir(2)), got) == 2 and torch.equal(got["w"], torch.ones(1000))  # never overwritten
        assert ckpt.load(str(tmp_path / step_dir(3)), got) == 3 and torch.equal(got["w"], torch.full((1000,), 3.0))
