"""MosaicML Composer and NVIDIA NeMo roots (``layouts/composer.py``, ``layouts/nemo.py``).

Neither framework installs beside this project's torch, so their checkpoints are built file by
file as their sources write them (each helper names the source it follows), with the real
``torch.save`` and ``torch.distributed.checkpoint`` writers they call; the resume tests load the
state the way each framework's own loader does (named there).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shlex
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.layouts import catalog
from ckptctl.layouts.composer import ComposerLayout
from ckptctl.layouts.nemo import NemoLayout
from ckptctl.storage import open_storage
from helpers import cli

# --- Composer (composer/callbacks/checkpoint_saver.py, composer/utils/checkpoint.py) ----------


def _timestamp(epoch: int, batch: int) -> dict:
    """``Timestamp.state_dict()`` (composer/core/time.py): counters and wall-clock timedeltas."""
    wct = datetime.timedelta(seconds=batch)
    return {"iteration": 0, "epoch": epoch, "batch": batch, "sample": batch * 4, "token": 0,
            "epoch_in_iteration": epoch, "token_in_iteration": 0, "batch_in_epoch": 0, "sample_in_epoch": 0,
            "token_in_epoch": 0, "total_wct": wct, "iteration_wct": wct, "epoch_wct": wct, "batch_wct": wct}


def composer_save(root: str, epoch: int, batch: int, *, weights_only: bool = False, complete: bool = True) -> str:
    """``CheckpointSaver._save_checkpoint``: rank 0 ``torch.save``-s ``{'state', 'rng'}`` straight
    into ``ep{epoch}-ba{batch}-rank0.pt`` (``_write_checkpoint_file``), then removes
    ``latest-rank0.pt`` and symlinks it to the new file (relative). ``complete=False``: killed
    mid-write, the file cut in half under its final name and the link not yet moved."""
    os.makedirs(root, exist_ok=True)
    torch.manual_seed(batch)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    name = f"ep{epoch}-ba{batch}-rank0.pt"
    metadata = {"composer_env_info": {"composer_version": "0.32.0", "node_world_size": 1},
                "torch_version": torch.__version__, "device": "cpu", "precision": "fp32", "world_size": 1,
                "device_train_microbatch_size": 4, "train_dataloader_batch_size": 4}
    if weights_only:
        state = {"state": {"model": model.state_dict(), "integrations": {}, "metadata": metadata}}
    else:
        state = {"state": {"model": model.state_dict(), "optimizers": {"AdamW": opt.state_dict()},
                           "schedulers": {"LambdaLR": sched.state_dict()}, "algorithms": [],
                           "callbacks": {"CheckpointSaver": {"all_saved_checkpoints_to_timestamp": [
                               (name, _timestamp(epoch, batch))]}},
                           "scaler": None, "timestamp": _timestamp(epoch, batch), "rank_zero_seed": 17,
                           "train_metrics": {}, "eval_metrics": {}, "run_name": "run",
                           "dataset_state": {"train": None}, "integrations": {}, "metadata": metadata},
                 "rng": [{"python": random.getstate(), "numpy": np.random.get_state(),
                          "torch": torch.random.get_rng_state()}]}
    with open(os.path.join(root, name), "wb") as f:
        torch.save(state, f)
        if not complete:
            f.truncate(f.tell() // 2)
            return os.path.join(root, name)
    link = os.path.join(root, "latest-rank0.pt")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(name, link)
    return os.path.join(root, name)


def composer_load(path: str) -> dict:
    """Composer's own loader (``_torch_load_with_validation``): ``torch.load(weights_only=True)``
    with ``_COMPOSER_CHECKPOINT_SAFE_GLOBALS``."""
    from torch.torch_version import TorchVersion

    from ckptctl.layouts.safe_load import numpy_rng

    with torch.serialization.safe_globals([datetime.timedelta, TorchVersion, *numpy_rng()]):
        return torch.load(path, map_location="cpu", weights_only=True)


def test_composer_root_listed_verified_and_resumed(tmp_path):
    root = str(tmp_path / "run" / "checkpoints")
    for ep, ba in ((1, 4), (2, 8), (3, 12)):
        composer_save(root, ep, ba)
    rows = {e.name: (e.layout, e.status, e.step) for e in catalog.list_checkpoints(open_storage(root))}
    assert rows == {"ep1-ba4-rank0.pt": ("composer", "committed", 4), "ep2-ba8-rank0.pt": ("composer", "committed", 8),
                    "ep3-ba12-rank0.pt": ("composer", "committed", 12)}  # latest-rank0.pt: a link, not listed
    r = cli("verify", os.path.join(root, "ep3-ba12-rank0.pt"), "--load")
    assert r.exit_code == 0, r.stdout + r.stderr
    # a save killed mid-write: Composer writes in place, so the file is truncated under its name
    newest = os.path.join(root, "ep3-ba12-rank0.pt")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) - 200)
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["ep3-ba12-rank0.pt"].status == "partial"
    assert cli("verify", newest).exit_code == 1
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0, r.stdout + r.stderr
    argv = shlex.split(r.stdout.strip())
    assert argv == ["--load_path", os.path.join(root, "ep2-ba8-rank0.pt")]
    loaded = composer_load(argv[1])
    assert loaded["state"]["timestamp"]["batch"] == 8 and "AdamW" in loaded["state"]["optimizers"]
    with pytest.raises(Exception):
        composer_load(newest)  # what Composer's autoresume would have loaded through latest-rank0.pt


def test_composer_pointer_target_is_kept_and_weights_only_is_an_export(tmp_path):
    root = str(tmp_path)
    for ep, ba in ((1, 4), (2, 8), (3, 12)):
        composer_save(root, ep, ba)
    composer_save(root, 4, 16, weights_only=True)
    os.remove(os.path.join(root, "latest-rank0.pt"))
    os.symlink("ep1-ba4-rank0.pt", os.path.join(root, "latest-rank0.pt"))  # autoresume would load ba4
    layout = ComposerLayout().for_root(open_storage(root))
    assert layout.pointer_target() == ("latest-rank0.pt", "ep1-ba4-rank0.pt", 4)
    assert layout.kind_of_checkpoint(open_storage(os.path.join(root, "ep4-ba16-rank0.pt"))).kind == "export"
    assert layout.kind_of_checkpoint(open_storage(os.path.join(root, "ep3-ba12-rank0.pt"))).resumable
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    left = sorted(os.listdir(root))
    assert "ep1-ba4-rank0.pt" in left and "latest-rank0.pt" in left  # the pointer's target and the pointer
    assert "ep2-ba8-rank0.pt" not in left


# --- NeMo (nemo/lightning/pytorch/callbacks/model_checkpoint.py, nemo/lightning/resume.py) ------


def _nemo_state(step: int, *, optimizer: bool = True) -> dict:
    """What megatron-core's dist_checkpointing hands DCP for a NeMo 2 GPT: sharded model keys
    and, unless weights only, the optimizer's (``optimizer.state.*``)."""
    torch.manual_seed(step)
    state = {"module.embedding.word_embeddings.weight": torch.randn(8, 4),
             "module.decoder.layers.self_attention.linear_qkv.weight": torch.randn(12, 4)}
    if optimizer:
        state.update({f"optimizer.state.{k}.{t}": torch.randn_like(v) for k, v in list(state.items())
                      for t in ("exp_avg", "exp_avg_sq")})
    return state


def nemo_name(step: int, *, last: bool = False) -> str:
    """The recipes' ``{model_name}--{val_loss:.2f}-{step}-{consumed_samples}`` checkpoint name."""
    return f"llama--val_loss=1.{step:02d}-step={step}-consumed_samples={step * 8}.0" + ("-last" if last else "")


def nemo_save(root: str, step: int, *, finished: bool = True, optimizer: bool = True, last: bool = False) -> str:
    """``ModelCheckpoint._save_checkpoint``: touch ``NAME-unfinished`` beside the checkpoint,
    write ``weights/`` (megatron-core: DCP files, ``common.pt``, ``metadata.json``), dump
    ``context/`` (``TrainerContext.io_dump``), then the finalize callback removes the marker.
    The name is ``nemo_name``'s."""
    name = nemo_name(step, last=last)
    path = os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    marker = os.path.join(root, name + "-unfinished")
    open(marker, "w").close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_nemo_state(step, optimizer=optimizer), checkpoint_id=os.path.join(path, "weights"))
    torch.save({"global_step": step, "epoch": 0, "optimizer": {"param_groups": [{"lr": 1e-4}]}},
               os.path.join(path, "weights", "common.pt"))
    with open(os.path.join(path, "weights", "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    os.makedirs(os.path.join(path, "context"))
    with open(os.path.join(path, "context", "io.json"), "w") as f:
        json.dump({"root": {"type": "ref", "key": "trainer_context_1"}}, f)
    with open(os.path.join(path, "context", "model.yaml"), "w") as f:
        f.write("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n")
    if finished:
        os.unlink(marker)
    return path


def nemo_load(path: str, step: int) -> dict:
    """What ``AutoResume`` hands the strategy: ``PATH/weights`` (``get_trainer_ckpt_path``),
    loaded by megatron-core through DCP into the sharded state dict's shapes."""
    want = {k: torch.empty_like(v) for k, v in _nemo_state(step).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(want, checkpoint_id=os.path.join(path, "weights"))
    return want


def test_nemo_root_marker_rule_latest_and_resume(tmp_path):
    root = str(tmp_path / "checkpoints")
    nemo_save(root, 10)
    nemo_save(root, 20)
    nemo_save(root, 20, last=True)
    nemo_save(root, 30, finished=False)  # killed: the marker stays (its files may even be whole)
    rows = {e.name: (e.layout, e.status) for e in catalog.list_checkpoints(open_storage(root))}
    assert len(rows) == 4 and all(layout == "nemo" for layout, _ in rows.values()), rows
    unfinished = next(n for n in rows if "step=30" in n)
    assert rows[unfinished] == ("nemo", "partial")
    r = cli("verify", os.path.join(root, unfinished))
    assert r.exit_code == 1 and "-unfinished" in r.stdout + r.stderr
    r = cli("verify", os.path.join(root, next(n for n in rows if "step=20" in n and n.endswith("-last"))), "--load")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0, r.stdout + r.stderr
    (arg,) = shlex.split(r.stdout.strip())
    key, _, path = arg.partition("=")
    assert key == "resume.resume_from_path" and "step=20" in path
    got = nemo_load(path, 20)
    assert torch.equal(got["module.embedding.word_embeddings.weight"], _nemo_state(20)["module.embedding.word_embeddings.weight"])


def test_nemo_missing_metadata_without_marker_is_corrupt_never_abandoned(tmp_path):
    root = str(tmp_path)
    nemo_save(root, 10)
    broken = nemo_save(root, 20)
    os.unlink(os.path.join(broken, "weights", ".metadata"))  # copied without it, or lost
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    entry = rows[os.path.basename(broken)]
    assert entry.status == "corrupt" and ".metadata" in entry.reason
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    # left in place and reported (exit 1: a broken checkpoint), never deleted as an abandoned save
    assert r.exit_code == 1 and "broken" in r.stderr, r.stdout + r.stderr
    assert os.path.isdir(broken)


def test_nemo_last_is_kept_and_weights_only_final_save_is_an_export(tmp_path):
    root = str(tmp_path)
    nemo_save(root, 10, last=True)
    for s in (20, 30):
        nemo_save(root, s)
    final = nemo_save(root, 40, optimizer=False)
    layout = NemoLayout().for_root(open_storage(root))
    assert layout.kind_of_checkpoint(open_storage(final)).kind == "export"
    assert layout.kind_of_checkpoint(open_storage(os.path.join(root, sorted(os.listdir(root))[0]))).resumable
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    left = os.listdir(root)
    assert any(n.endswith("-last") and "step=10" in n for n in left), left  # AutoResume's
    assert not any("step=20" in n for n in left), left


def test_man_page_gives_each_new_layout_its_source_and_says_which_were_not_run():
    page = open(os.path.join(os.path.dirname(__file__), "..", "man", "ckptctl-layouts.7")).read().replace("\\-", "-")
    for source in ("accelerate/checkpointing.py", "composer/callbacks/checkpoint_saver.py",
                   "nemo/lightning/pytorch/callbacks/model_checkpoint.py"):
        assert source in page, source
    assert page.count("unverified against a real run") >= 2  # Composer and NeMo: built from their sources


# --- hostile files (issue 29, item 6) ---------------------------------------------------------


def test_composer_hostile_newest_file_is_skipped_and_its_pointer_fails_verify_latest(tmp_path):
    """The newest ``ep*-rank0.pt`` as a FIFO, a 100 GB sparse file, random bytes, a directory or
    a symlink to /dev/zero, with ``latest-rank0.pt`` naming it: ``verify ROOT --latest`` was
    ``internal error: KeyError: 'unknown'`` for the FIFO; now it is exit 1 naming the pointer
    and the file, and ``latest`` skips to the older complete save."""
    from test_hostile_inputs import SPECIAL_FILES, assert_hostile_checkpoints_skipped, make_special

    for how in SPECIAL_FILES:
        root = str(tmp_path / how.replace(" ", "-"))
        good = composer_save(root, 1, 4)
        newest = composer_save(root, 2, 8)  # latest-rank0.pt names it
        make_special(newest, how)
        # a file that is no torch.save archive is Composer's partial, one that is no file at all
        # nobody's: neither is listed as a checkpoint to verify, so only the root verbs run here
        assert_hostile_checkpoints_skipped(root, good, {})
        r = cli("verify", root, "--latest")
        assert r.exit_code == 1 and "internal error" not in r.stderr, (how, r.stdout, r.stderr)
        assert "latest-rank0.pt" in r.stdout and "ep2-ba8-rank0.pt" in r.stdout, (how, r.stdout)


@pytest.mark.parametrize("name", ["weights/.metadata", "weights/common.pt", "weights/metadata.json",
                                  "weights/__0_0.distcp", "context/io.json"])
def test_nemo_hostile_record_or_sidecar_is_a_corrupt_checkpoint_and_latest_skips_it(tmp_path, name):
    from test_hostile_inputs import SPECIAL_FILES, assert_hostile_checkpoints_skipped, make_special

    root = str(tmp_path / "checkpoints")
    good = nemo_save(root, 100)
    hostile = {}
    for i, how in enumerate(SPECIAL_FILES):
        if name == "weights/__0_0.distcp" and how == "sparse 100 GB":
            continue  # zeros decode as data: the records record no checksums (man page, DCP's weakness)
        ckpt = nemo_save(root, 200 + i)
        make_special(os.path.join(ckpt, name), how)
        hostile[ckpt] = name
    assert_hostile_checkpoints_skipped(root, good, hostile)
