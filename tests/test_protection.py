"""Protected means protected: what a pointer names, a best checkpoint, and anything that cannot
be read safely enough to decide are kept by prune, rm and library retention.

Cases of the adversarial run against main (their numbers in the trust issue): 2, Lightning's
best deleted (a ``pathlib.Path`` in ``save_hyperparameters()``, two ``ModelCheckpoint``
callbacks); 3, a pointer's symlinked step directory deleted; 12, a Lightning file whose
``callbacks`` is not a dict failing root-wide verbs. Real Lightning runs, real files and
symlinks. Case 8 is in ``test_retention_recovery.py``, case 17 in ``test_sync_safety.py``.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from ckptctl import Checkpointer
from helpers import cli
from test_layouts import deepspeed_tag, hf_checkpoint, megatron_iter


def _plan(r) -> dict[str, dict]:
    return {i["name"]: i for i in r.json()["plan"]["items"]}


def _steps(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-"))


# --- 2: Lightning's best checkpoints ---------------------------------------------------------


def _lightning_fit(out: str, callbacks: list, max_steps: int, **hparams) -> None:
    L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")

    class Tiny(L.LightningModule):
        def __init__(self, **kwargs) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            loss = self.layer(batch).pow(2).mean()
            self.log("score", -float(self.global_step))  # the first save of each callback is its best
            self.log("other", -float(self.global_step))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)
    trainer = L.Trainer(max_steps=max_steps, callbacks=callbacks, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(**hparams), data)


def test_lightning_best_is_kept_when_hyperparameters_hold_a_path(tmp_path):
    """``save_hyperparameters()`` with a ``pathlib.Path`` argument: ``weights_only`` refused the
    whole file, the error was swallowed and the best was taken as absent, then deleted."""
    ModelCheckpoint = pytest.importorskip("lightning.pytorch.callbacks", reason="lightning is not installed (pip install -e '.[frameworks]')").ModelCheckpoint

    out = str(tmp_path / "ckpts")
    saver = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, monitor="score", mode="max")
    _lightning_fit(out, [saver], 6, data_dir=pathlib.Path("/data/shards"))
    assert sorted(os.listdir(out)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    r = cli("prune", out, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    assert plan["epoch=0-step=2.ckpt"]["action"] == "keep", plan["epoch=0-step=2.ckpt"]
    assert "best_model_path" in plan["epoch=0-step=2.ckpt"]["reason"]
    assert plan["epoch=0-step=4.ckpt"]["action"] == "delete"
    assert sorted(os.listdir(out)) == ["epoch=0-step=2.ckpt", "epoch=0-step=6.ckpt"]
    # The Path is rebuilt as a path, no code of the file run: the file test-loads in full.
    r = cli("verify", os.path.join(out, "epoch=0-step=6.ckpt"), "--load", "--json")
    assert r.exit_code == 0 and "not test-loaded" not in r.stdout, r.stdout


def test_lightning_every_model_checkpoint_callbacks_best_is_kept(tmp_path):
    """Two ``ModelCheckpoint`` callbacks monitoring different metrics: only the first one's
    best was protected."""
    ModelCheckpoint = pytest.importorskip("lightning.pytorch.callbacks", reason="lightning is not installed (pip install -e '.[frameworks]')").ModelCheckpoint

    out = str(tmp_path / "ckpts")
    by_score = ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=-1, monitor="score", mode="max")
    by_other = ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1, monitor="other", mode="max")
    _lightning_fit(out, [by_score, by_other], 8)
    steps = {"epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}
    assert set(os.listdir(out)) == steps
    r = cli("prune", out, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    for best in ("epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"):  # each callback's first save
        assert plan[best]["action"] == "keep" and "best_model_path" in plan[best]["reason"], plan[best]
    assert plan["epoch=0-step=6.ckpt"]["action"] == "delete"
    assert set(os.listdir(out)) == steps - {"epoch=0-step=6.ckpt"}


class _Opaque:
    """A class no allow-list names, as a LightningModule may keep among its hyperparameters."""


def _lightning_file(root: str, step: int, **fields) -> str:
    """A ``.ckpt`` file with the keys Lightning's ``dump_checkpoint`` writes, ``fields`` over them."""
    path = os.path.join(root, f"epoch=0-step={step}.ckpt")
    doc = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(4)},
           "loops": {}, "optimizer_states": [{"state": {}, "param_groups": []}], "lr_schedulers": [],
           "callbacks": {"ModelCheckpoint{'monitor': 'score'}": {
               "best_model_path": os.path.join(root, "epoch=0-step=1.ckpt"), "best_model_score": torch.tensor(1.0)}}}
    doc.update(fields)
    os.makedirs(root, exist_ok=True)
    torch.save(doc, path)
    return path


CALLBACK_SHAPES = {
    "list": [{"best_model_path": "x"}],
    "string": "ModelCheckpoint",
    "number": 7,
    "state-not-a-dict": {"ModelCheckpoint{'monitor': 'score'}": ["epoch=0-step=1.ckpt"]},
    "best-not-a-path": {"ModelCheckpoint{'monitor': 'score'}": {"best_model_path": 5}},
    "state-without-best": {"ModelCheckpoint{'monitor': 'score'}": {"dirpath": "/x"}},
}


@pytest.mark.parametrize("shape", sorted(CALLBACK_SHAPES))
def test_lightning_callbacks_that_cannot_be_understood_keep_every_file_and_fail_no_verb(tmp_path, shape):
    """A ``callbacks`` that is not Lightning's dict of states: prune raised AttributeError
    (exit 3) or took the best as absent. Now the best is unknown, every complete file is kept
    and the plan says why; ls, latest and verify --all go on."""
    root = str(tmp_path)
    for s in (1, 2):
        _lightning_file(root, s)
    _lightning_file(root, 3, callbacks=CALLBACK_SHAPES[shape])
    assert cli("ls", root).exit_code == 0
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip().endswith("epoch=0-step=3.ckpt"), r.stdout + r.stderr
    assert cli("verify", root, "--all").exit_code == 0
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    for name in ("epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"):
        assert plan[name]["action"] == "keep" and "kept for safety" in plan[name]["reason"], plan[name]
        assert "epoch=0-step=3.ckpt" in plan[name]["reason"]  # names the file it could not read
    assert len(os.listdir(root)) == 3


def test_lightning_best_unreadable_for_a_class_beyond_the_allow_list_keeps_every_file(tmp_path):
    root = str(tmp_path)
    for s in (1, 2):
        _lightning_file(root, s)
    _lightning_file(root, 3, hyper_parameters={"opaque": _Opaque()})
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    # The newest decodes structurally at load (a class name alone fails nothing): the anchor.
    assert r.exit_code == 0, r.stdout + r.stderr
    reason = _plan(r)["epoch=0-step=2.ckpt"]["reason"]
    assert "cannot be read safely" in reason and "kept for safety" in reason and "_Opaque" in reason, reason
    assert len(os.listdir(root)) == 3


def test_lightning_without_callback_states_prunes_by_the_older_files_best(tmp_path):
    """A newest file saved without callbacks (None or missing) says nothing: the next older
    file's best is kept, and the rest goes by the policy."""
    root = str(tmp_path)
    for s in (1, 2, 3):
        _lightning_file(root, s)
    _lightning_file(root, 4, callbacks=None)
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    assert plan["epoch=0-step=1.ckpt"]["action"] == "keep" and "best_model_path" in plan["epoch=0-step=1.ckpt"]["reason"]
    assert [plan[f"epoch=0-step={s}.ckpt"]["action"] for s in (2, 3)] == ["delete", "delete"]


def test_lightning_last_model_path_is_kept_like_the_best(tmp_path):
    """``trainer.fit(ckpt_path="last")`` resumes from ``last_model_path``: kept when its name has
    a step (a ``CHECKPOINT_NAME_LAST`` template), as the best is."""
    root = str(tmp_path)
    state = {"best_model_path": os.path.join(root, "epoch=0-step=1.ckpt"),
             "last_model_path": os.path.join(root, "last-step=2.ckpt")}
    _lightning_file(root, 1)
    os.rename(_lightning_file(root, 2), os.path.join(root, "last-step=2.ckpt"))
    for s in (3, 4):
        _lightning_file(root, s, callbacks={"ModelCheckpoint{'monitor': 'score'}": state})
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    assert "best_model_path" in plan["epoch=0-step=1.ckpt"]["reason"]
    assert plan["last-step=2.ckpt"]["action"] == "keep" and "last_model_path" in plan["last-step=2.ckpt"]["reason"]
    assert plan["epoch=0-step=3.ckpt"]["action"] == "delete"


def test_library_retention_in_a_root_shared_with_a_lightning_file_whose_callbacks_is_a_list(tmp_path):
    root = str(tmp_path)
    _lightning_file(root, 7, callbacks=[1, 2])
    with Checkpointer(root, keep_last=1) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"model": {"w": torch.full((10,), float(s))}}).wait()
    assert _steps(root) == [3]
    assert os.path.isfile(os.path.join(root, "epoch=0-step=7.ckpt"))


# --- 3: a pointer's target that is a symlinked step directory --------------------------------


def _deepspeed(root: str, away: str) -> tuple[str, str]:
    for s in (10, 20):
        deepspeed_tag(root, s)
    deepspeed_tag(away, 30, latest=False)
    os.symlink(os.path.join(away, "global_step30"), os.path.join(root, "global_step30"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step30")
    return "global_step30", "`latest` names it"


def _megatron(root: str, away: str) -> tuple[str, str]:
    for it in (100, 200):
        megatron_iter(root, it)
    megatron_iter(away, 300, tracker=False)
    os.symlink(os.path.join(away, "iter_0000300"), os.path.join(root, "iter_0000300"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("300")
    return "iter_0000300", "latest_checkpointed_iteration.txt names it"


def _trainer(root: str, away: str) -> tuple[str, str]:
    os.makedirs(root)
    hf_checkpoint(away, 1)
    os.symlink(os.path.join(away, "checkpoint-1"), os.path.join(root, "checkpoint-1"))
    for s in (2, 3):
        hf_checkpoint(root, s, best=os.path.join(root, "checkpoint-1"))
    return "checkpoint-1", "best_model_checkpoint"


@pytest.mark.parametrize("stack", [_deepspeed, _megatron, _trainer], ids=["deepspeed", "megatron", "hf-trainer"])
def test_a_pointer_target_that_is_a_symlinked_step_directory_is_kept(tmp_path, stack):
    root, away = str(tmp_path / "root"), str(tmp_path / "other-volume")
    link, why = stack(root, away)
    target = os.readlink(os.path.join(root, link))
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    item = _plan(r)[link]
    assert item["action"] == "keep" and why in item["reason"] and "symlink" in item["reason"], item
    assert os.path.islink(os.path.join(root, link)) and os.path.isdir(target) and os.listdir(target)
    r = cli("rm", os.path.join(root, link), "--yes")
    assert r.exit_code == 1 and "protected" in r.stderr and "--force" in r.stderr, r.stderr
    assert os.path.islink(os.path.join(root, link))


def test_a_protected_symlink_keeps_its_target_in_the_same_root(tmp_path):
    """``latest`` names a link to another tag of the same root: both stay, whatever the policy."""
    root = str(tmp_path)
    for s in (10, 20, 30):
        deepspeed_tag(root, s)
    os.symlink("global_step10", os.path.join(root, "global_step40"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step40")
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    assert plan["global_step40"]["action"] == "keep"
    assert plan["global_step10"]["action"] == "keep" and "global_step40" in plan["global_step10"]["reason"]
    assert plan["global_step20"]["action"] == "delete"
    assert sorted(os.listdir(root)) == ["global_step10", "global_step30", "global_step40", "latest"]


def test_an_unlinked_symlink_nothing_names_is_still_removed_link_only(tmp_path):
    root, away = str(tmp_path / "root"), str(tmp_path / "away")
    _deepspeed(root, away)
    deepspeed_tag(away, 5, latest=False)
    os.symlink(os.path.join(away, "global_step5"), os.path.join(root, "global_step5"))
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0 and _plan(r)["global_step5"]["action"] == "delete"
    assert not os.path.lexists(os.path.join(root, "global_step5"))
    assert os.listdir(os.path.join(away, "global_step5"))  # the target untouched


def test_library_retention_leaves_another_stacks_symlinks_alone(tmp_path):
    root, away = str(tmp_path / "root"), str(tmp_path / "away")
    _deepspeed(root, away)
    deepspeed_tag(away, 5, latest=False)
    os.symlink(os.path.join(away, "global_step5"), os.path.join(root, "global_step5"))
    with Checkpointer(root, keep_last=1) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.ones(4)}).wait()
    assert os.path.islink(os.path.join(root, "global_step5")) and os.path.islink(os.path.join(root, "global_step30"))
    assert _steps(root) == [2]


def test_a_garbled_megatron_tracker_keeps_every_iteration(tmp_path):
    """Megatron rewrites its tracker in place: cut short, it is empty. Every iteration read as
    Megatron's own incomplete save (partial), one rule away from deletion as abandoned; which
    one the tracker named is unknown, so each is corrupt: reported, never deleted."""
    root = str(tmp_path)
    for it in (100, 200):
        megatron_iter(root, it)
    open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").close()
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--delete-broken", "--yes", "--json")
    assert r.exit_code == 1, r.stdout + r.stderr  # nothing verifies: refused
    assert sorted(os.listdir(root)) == ["iter_0000100", "iter_0000200", "latest_checkpointed_iteration.txt"]
    assert {e["status"] for e in cli("ls", root, "--json").json()["checkpoints"]} == {"corrupt"}


def test_a_trainer_best_that_is_not_a_path_keeps_every_checkpoint(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3):
        hf_checkpoint(root, s)
    state = os.path.join(root, "checkpoint-3", "trainer_state.json")
    with open(state, "w") as f:
        json.dump({"global_step": 3, "best_model_checkpoint": ["checkpoint-1"], "log_history": []}, f)
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = _plan(r)
    for name in ("checkpoint-1", "checkpoint-2"):
        assert plan[name]["action"] == "keep" and "kept for safety" in plan[name]["reason"], plan[name]




def test_iterations_whose_tracker_was_lost_are_never_taken_for_abandoned_saves(tmp_path):
    """No tracker at all: an iteration with every file reads as corrupt (reported, kept: the
    tracker was lost as likely as the first save cut short); one missing its files is partial."""
    root = str(tmp_path)
    for it in (100, 200):
        megatron_iter(root, it, tracker=False)
    os.makedirs(os.path.join(root, "iter_0000300"))  # made before any rank wrote
    r = cli("ls", root, "--json")
    assert {e["name"]: e["status"] for e in r.json()["checkpoints"]} == {
        "iter_0000100": "corrupt", "iter_0000200": "corrupt", "iter_0000300": "partial"}
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes")
    assert r.exit_code == 1  # nothing verifies: refused, nothing deleted
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--dry-run", "--json")
    plan = _plan(r)
    assert plan["iter_0000100"]["action"] == plan["iter_0000200"]["action"] == "skip"
    assert sorted(os.listdir(root)) == ["iter_0000100", "iter_0000200", "iter_0000300"]
