"""The members of the ``Layout`` protocol the verbs ask instead of a layout's name (issue 19):
every registered layout answers them, and a third-party layout that sets none of them gets
the defaults of another tool's checkpoints (checked by its own rules, never ``rm``'s)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ckptctl.format.layout import MARKER
from ckptctl.format.seal import Seal
from ckptctl.layouts import catalog
from ckptctl.layouts.base import Layout, Resume
from ckptctl.layouts.hf_trainer import HfTrainerLayout
from ckptctl.layouts.native import NAME as NATIVE_NAME
from ckptctl.layouts.stack import StackLayout
from ckptctl.storage import open_storage


@pytest.mark.parametrize("layout", catalog.LAYOUTS, ids=lambda layout: layout.name)
def test_every_layout_answers_the_protocol(layout: Layout, tmp_path: Path) -> None:
    assert isinstance(layout.verified_by_manifest, bool)
    assert isinstance(layout.written_by_ckptctl, bool)
    assert layout.commit_marker is None or isinstance(layout.commit_marker, str)
    assert isinstance(layout.resume("/r/c", 5), Resume)
    assert layout.recorded_metrics(open_storage(str(tmp_path)), []) == {}


def test_a_third_party_layout_gets_the_defaults_of_another_tools_checkpoints() -> None:
    class Bare(StackLayout):
        name = "bare"

    bare = Bare()
    assert (bare.verified_by_manifest, bare.written_by_ckptctl, bare.commit_marker) == (False, False, None)
    toy = catalog.layout_called("toy")
    if toy is not None:  # installed by scripts/setup.sh
        assert (toy.verified_by_manifest, toy.written_by_ckptctl, toy.commit_marker) == (False, False, None)


def test_ckptctls_own_layout_is_verified_by_its_manifest_and_committed_by_its_marker() -> None:
    own = catalog.layout_called(NATIVE_NAME)
    assert own is not None
    assert own.verified_by_manifest and own.written_by_ckptctl and own.commit_marker == MARKER
    assert own.resume("/r/step-1", 1).option.startswith("Checkpointer(ROOT).load_latest")


def test_layout_called_names_no_layout_for_unknown() -> None:
    assert catalog.layout_called("unknown") is None
    assert catalog.layout_called("no-such-layout") is None


def test_a_seal_of_another_layout_is_named() -> None:
    hf = HfTrainerLayout()
    seal = Seal("dcp", "checkpoint-1", 1, 0.0, {}, ())
    assert hf.sealed_as_another(seal) == "sealed as a dcp checkpoint, now read as hf-trainer"
    assert hf.sealed_as_another(replace(seal, layout="hf-trainer")) is None


def test_trainer_metrics_stay_with_the_trainers_checkpoints(tmp_path: Path) -> None:
    # best_model_checkpoint naming a directory of another layout gives that directory nothing.
    for step, loss in ((10, 0.5), (20, 0.4)):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        with open(tmp_path / f"checkpoint-{step}" / "trainer_state.json", "w") as f:
            json.dump({"global_step": step, "log_history": [{"step": step, "eval_loss": loss}],
                       "best_model_checkpoint": "out/step-0000000010", "best_metric": loss}, f)
    root = open_storage(str(tmp_path))
    got = HfTrainerLayout().recorded_metrics(root, [("checkpoint-10", 10), ("checkpoint-20", 20)])
    assert got["checkpoint-10"] == {"eval_loss": 0.5}
    assert got["checkpoint-20"] == {"eval_loss": 0.4}
    assert got["step-0000000010"] == {"best_metric": 0.4}  # the layout's own answer, by name
    # Through the catalog: only listed, committed entries get metrics.
    assert catalog.recorded_metrics(root, catalog.list_checkpoints(root)) == {
        "checkpoint-10": {"eval_loss": 0.5}, "checkpoint-20": {"eval_loss": 0.4}}
