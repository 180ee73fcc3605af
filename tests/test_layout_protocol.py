"""The ``Layout`` protocol (``layouts.base``) every verb asks instead of a layout's name or type
(issues 19 and 28): every registered layout has every member, ckptctl's own format is one
implementation among them (special nowhere: no flag tells it apart), and a plugin that only
implements the protocol, subclassing nothing, is registered like the built-in ones."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ckptctl.format.layout import MARKER
from ckptctl.format.seal import Seal
from ckptctl.layouts import catalog
from ckptctl.layouts.base import MEMBERS, Layout, Resume
from ckptctl.layouts.hf_trainer import HfTrainerLayout
from ckptctl.layouts.native import NAME as NATIVE_NAME
from ckptctl.layouts.stack import StackLayout
from ckptctl.storage import open_storage
from helpers import make_checkpoints


@pytest.mark.parametrize("layout", catalog.LAYOUTS, ids=lambda layout: layout.name)
def test_every_layout_answers_the_protocol(layout: Layout, tmp_path: Path) -> None:
    missing = [m for m in MEMBERS if not hasattr(layout, m)]
    assert not missing, f"{layout.name} lacks {missing}"
    assert isinstance(layout.name, str) and isinstance(layout.title, str)
    assert layout.commit_marker is None or isinstance(layout.commit_marker, str)
    assert isinstance(layout.commit_files, tuple)
    assert isinstance(layout.resume("/r/c", 5), Resume)
    assert layout.recorded_metrics(open_storage(str(tmp_path)), []) == {}
    assert layout.for_root(open_storage(str(tmp_path))).name == layout.name


def test_the_flags_that_told_ckptctls_own_format_apart_are_gone() -> None:
    for layout in catalog.LAYOUTS:
        for flag in ("verified_by_manifest", "written_by_ckptctl"):
            assert not hasattr(layout, flag), f"{layout.name} still has {flag}: ask the protocol instead"
    assert "verified_by_manifest" not in MEMBERS and "written_by_ckptctl" not in MEMBERS


def test_the_toy_plugin_implements_the_protocol_and_subclasses_nothing() -> None:
    toy = catalog.layout_called("toy")
    assert toy is not None, "the toy layout plugin is not installed: bash scripts/setup.sh"
    assert not isinstance(toy, StackLayout)
    assert type(toy).__mro__[1:] == (object,)


def test_ckptctls_own_layout_is_committed_by_its_marker_and_names_its_manifest(tmp_path: Path) -> None:
    own = catalog.layout_called(NATIVE_NAME)
    assert own is not None and own.commit_marker == MARKER
    assert own.resume("/r/step-1", 1).option.startswith("Checkpointer(ROOT).load_latest")
    (path,) = make_checkpoints(str(tmp_path), [1], size=64, tensors=2)
    ckpt = open_storage(path)
    assert own.identity(ckpt) is not None and own.reads_on_resume("rank-00000-of-00001.safetensors")
    os.unlink(os.path.join(path, MARKER))
    assert own.identity(ckpt) is None  # nothing names its contents: never in the verification record


def test_layout_called_names_no_layout_for_unknown() -> None:
    assert catalog.layout_called("unknown") is None
    assert catalog.layout_called("no-such-layout") is None


def test_a_seal_of_another_layout_is_named() -> None:
    hf = HfTrainerLayout()
    seal = Seal("dcp", "checkpoint-1", 1, 0.0, {}, ())
    assert hf.sealed_as_another(seal) == "sealed as a dcp checkpoint, now read as hf-trainer"
    assert hf.sealed_as_another(replace(seal, layout="hf-trainer")) is None


def test_the_trainer_names_the_files_its_resume_reads() -> None:
    hf = HfTrainerLayout()
    for read in ("trainer_state.json", "config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth", "rng_state_3.pth", "model-00001-of-00002.safetensors", "global_step7/x.pt"):
        assert hf.reads_on_resume(read), read
    for unread in ("training_args.bin", "tokenizer.json", "README.md", "generation_config.json"):
        assert not hf.reads_on_resume(unread), unread


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
