"""Issue 20, case 4: a model-only export is never chosen for a resume.

torchtitan's last step is model-only by default (``checkpoint.last_save_model_only``): ``latest
--format dcp`` returned it and torchtitan's ``load_step`` then failed with ``Missing key ...
dataloader``. Each layout now says whether a checkpoint is resumable or an export
(``kind_of_checkpoint``); ``latest`` and ``verify --latest`` skip exports unless ``--any`` and
say so; ``ls`` and ``inspect`` show ``export``; prune's anchor is never an export.

Checkpoints are real: DCP by ``torch.distributed.checkpoint.save``, ckptctl's own by the
``Checkpointer``, Trainer directories by ``test_layouts.hf_checkpoint`` (as
``Trainer._save_checkpoint`` writes them, ``save_only_model`` leaving out optimizer, scheduler
and RNG), Lightning files by ``torch.save`` of the dict ``dump_checkpoint`` builds
(``save_weights_only=True`` leaves out ``optimizer_states``, ``lr_schedulers`` and callbacks).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckptctl import Checkpointer
from ckptctl.layouts import catalog
from ckptctl.storage import open_storage
from helpers import cli
from test_layouts import hf_checkpoint, megatron_iter


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def titan_steps(root: str) -> tuple[str, str]:
    """step-10 as torchtitan saves a step (model keys flattened, then optimizer, lr_scheduler,
    dataloader, train_state: ``CheckpointManager._flattened_model_states_sd``), and step-20,
    its last step with ``last_save_model_only`` (``states[MODEL].state_dict()`` alone)."""
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    full = {**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": 10}, "dataloader": {"sampler_pos": 10},
            "train_state": {"step": 10}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full, checkpoint_id=os.path.join(root, "step-10"), no_dist=True)
        dcp.save(dict(msd), checkpoint_id=os.path.join(root, "step-20"), no_dist=True)
    return os.path.join(root, "step-10"), os.path.join(root, "step-20")


def _contents(root: str) -> dict[str, str | None]:
    r = cli("ls", root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return {c["name"]: c["content"] for c in r.json()["checkpoints"]}


def _anchor(root: str) -> str:
    r = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return r.json()["plan"]["anchor"]["name"]


def test_torchtitan_model_only_last_step_is_an_export_latest_skips_it(tmp_path):
    root = str(tmp_path)
    full, last = titan_steps(root)
    r = cli("latest", root, "--format", "dcp")
    assert r.exit_code == 0 and r.stdout.strip() == full, r.stdout + r.stderr
    assert f"skipped {last}: an export" in r.stderr and "--any" in r.stderr
    r = cli("latest", root, "--format", "dcp", "--json")
    doc = r.json()
    assert doc["content"] == "resumable" and [e["step"] for e in doc["skipped_exports"]] == [20]
    assert "model tensors" in doc["skipped_exports"][0]["reason"]
    assert cli("latest", root, "--any").stdout.strip() == last
    assert _contents(root) == {"step-10": "resumable", "step-20": "export"}
    table = cli("ls", root)
    assert "CONTENT" in table.stdout and "export" in table.stdout
    r = cli("inspect", last, "--json")
    assert r.exit_code == 0 and r.json()["content"] == "export", r.stdout
    assert _anchor(root) == "step-10"


def test_verify_latest_judges_the_newest_resumable_and_names_the_export(tmp_path):
    root = str(tmp_path)
    full, last = titan_steps(root)
    r = cli("verify", root, "--latest", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert [c["url"] for c in doc["checkpoints"]] == [full]
    assert [e["url"] for e in doc["skipped_exports"]] == [last]
    r = cli("verify", root, "--latest")
    assert r.exit_code == 0 and f"skipped {last}: an export" in r.stderr
    r = cli("verify", root, "--latest", "--any", "--json")
    assert r.exit_code == 0 and [c["url"] for c in r.json()["checkpoints"]] == [last]
    assert cli("verify", root, "--all", "--any").exit_code == 2  # --any goes with --latest


def test_a_root_of_exports_only_is_no_resume_and_says_any(tmp_path):
    root = str(tmp_path)
    _, last = titan_steps(root)
    import shutil

    shutil.rmtree(os.path.join(root, "step-10"))
    r = cli("latest", root)
    assert r.exit_code == 1 and r.stdout == ""
    assert "no resumable" in r.stderr and last in r.stderr and "--any" in r.stderr
    assert cli("verify", root, "--latest").exit_code == 1
    assert cli("latest", root, "--any").stdout.strip() == last


def test_hf_trainer_save_only_model_is_an_export(tmp_path):
    root = str(tmp_path)
    full = hf_checkpoint(root, 100)
    only = hf_checkpoint(root, 200, optimizer=False)  # save_only_model=True
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == full, r.stdout + r.stderr
    assert f"skipped {only}: an export" in r.stderr and "optimizer.pt" in r.stderr
    assert _contents(root) == {"checkpoint-100": "resumable", "checkpoint-200": "export"}
    assert _anchor(root) == "checkpoint-100"
    r = cli("prune", root, "--keep-last", "2", "--yes")  # the export is kept by policy, never relied on
    assert r.exit_code == 0 and os.path.isdir(only) and os.path.isdir(full)


def _lightning_ckpt(root: str, step: int, *, weights_only: bool) -> str:
    """As ``_CheckpointConnector.dump_checkpoint`` builds it; ``weights_only`` drops the
    optimizer and scheduler states and callbacks (``ModelCheckpoint(save_weights_only=True)``)."""
    path = os.path.join(root, f"epoch=0-step={step}.ckpt")
    doc: dict[str, object] = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.0",
                              "state_dict": {"w": torch.ones(4)}, "loops": {}}
    if not weights_only:
        doc.update({"optimizer_states": [{"state": {}, "param_groups": []}], "lr_schedulers": [], "callbacks": {}})
    os.makedirs(root, exist_ok=True)
    torch.save(doc, path)
    return path


def test_lightning_save_weights_only_is_an_export(tmp_path):
    root = str(tmp_path)
    full = _lightning_ckpt(root, 1, weights_only=False)
    only = _lightning_ckpt(root, 2, weights_only=True)
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == full, r.stdout + r.stderr
    assert "optimizer_states" in r.stderr
    assert _contents(root) == {"epoch=0-step=1.ckpt": "resumable", "epoch=0-step=2.ckpt": "export"}
    assert _anchor(root) == "epoch=0-step=1.ckpt"
    assert cli("inspect", only, "--json").json()["content"] == "export"


def test_ckptctl_save_without_an_optimizer_is_an_export(tmp_path):
    root = str(tmp_path)
    model, opt = _trained()
    with Checkpointer(root) as ck:
        full = ck.save(1, {"model": model, "optimizer": opt}).wait()
        only = ck.save(2, {"model": model}).wait()
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == full, r.stdout + r.stderr
    assert f"skipped {only}: an export" in r.stderr
    r = cli("inspect", only, "--json")
    assert r.json()["content"] == "export" and "model" in r.json()["content_reason"]
    assert cli("inspect", full, "--json").json()["content"] == "resumable"
    assert "content     export" in cli("inspect", only).stdout
    assert list(_contents(root).values()) == ["resumable", "export"]
    assert _anchor(root) == os.path.basename(full)


def test_an_optimizer_that_never_stepped_still_makes_it_resumable(tmp_path):
    # No optimizer tensors yet (Adam creates them at its first step): its param_groups say it.
    root = str(tmp_path)
    model = nn.Linear(4, 2)
    with Checkpointer(root) as ck:
        path = ck.save(0, {"model": model, "optimizer": torch.optim.Adam(model.parameters())}).wait()
    assert cli("inspect", path, "--json").json()["content"] == "resumable"


def test_megatron_no_save_optim_is_an_export(tmp_path):
    from ckptctl.layouts.base import kind_of_checkpoint  # the layout's answer (new in issue 20)

    root = str(tmp_path)
    megatron_iter(root, 1000)
    megatron_iter(root, 2000, optimizer=False)  # --no-save-optim; the tracker names it
    st = open_storage(root)
    kinds = {e.name: kind_of_checkpoint(catalog.layout_named(e.layout, st), e.storage)
             for e in catalog.list_checkpoints(st)}
    assert {n: k.kind for n, k in kinds.items()} == {"iter_0001000": "resumable", "iter_0002000": "export"}
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0 and r.stdout.split() == ["--load", root, "--ckpt-step", "1000"], r.stdout + r.stderr
