"""Other tools' checkpoints in a root: torchtitan/DCP (written by the real
``torch.distributed.checkpoint.save``), and Hugging Face Trainer, Megatron-LM and DeepSpeed
directories built file by file as their sources write them (each helper names the source).

The first test is the data-loss case of issue 12: complete DCP ``step-N`` directories beside a
ckptctl checkpoint were deleted as "abandoned: no marker".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ckptctl import Checkpointer
from ckptctl.layouts import catalog
from ckptctl.ops.verify.latest import latest_checkpoint
from ckptctl.ops.verify.latest import verify_root
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints

HOURS = 3600.0


def dcp_step(root: str, step: int, *, complete: bool = True, age_s: float = 0.0) -> str:
    """A torchtitan checkpoint (torchtitan/components/checkpoint.py: ``step-{step}`` under the
    checkpoint folder) written by the real DCP writer; ``complete=False`` is a save killed
    before ``.metadata`` (DCP renames it into place last)."""
    path = os.path.join(root, f"step-{step}")
    state = {"model": {"w": torch.full((64,), float(step)), "b": torch.arange(8.0)},
             "train_state": {"step": step}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)
    if not complete:
        os.unlink(os.path.join(path, ".metadata"))
    if age_s:
        _age(path, age_s)
    return path


def _age(path: str, age_s: float) -> None:
    old = time.time() - age_s
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
        os.utime(dirpath, (old, old))


def flip(path: str, at: int) -> None:
    """Invert one byte in place: same size, a changed value."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def tree_names(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


# --- issue 12's data loss --------------------------------------------------------------------


def _mixed_root(root: str) -> None:
    """One ckptctl checkpoint, complete DCP steps 100 and 200, all idle for hours, plus a
    step-named directory that no layout claims (a user's notes)."""
    make_checkpoints(root, [1])
    dcp_step(root, 100, age_s=7 * HOURS)
    dcp_step(root, 200, age_s=7 * HOURS)
    os.makedirs(os.path.join(root, "step-300"))
    with open(os.path.join(root, "step-300", "notes.txt"), "w") as f:
        f.write("not a checkpoint")
    _age(os.path.join(root, "step-300"), 7 * HOURS)


def test_checkpointer_retention_never_deletes_other_tools_checkpoints(tmp_path):
    root = str(tmp_path)
    _mixed_root(root)
    with Checkpointer(root, keep_last=1) as ck:
        for s in (2, 3):
            ck.save(s, {"model": {"w": torch.full((10,), float(s))}}).wait()
    names = tree_names(root)
    assert "step-100" in names and "step-200" in names and "step-300" in names
    assert os.path.exists(os.path.join(root, "step-200", ".metadata"))
    assert [n for n in names if n.startswith("step-00")] == ["step-0000000003"]


def test_prune_cli_never_deletes_complete_dcp_or_unrecognised_dirs_as_partial(tmp_path):
    root = str(tmp_path)
    _mixed_root(root)
    dcp_step(root, 250, complete=False, age_s=7 * HOURS)  # a save killed before .metadata
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["step-200"]["action"] == "keep" and plan["step-200"]["layout"] == "dcp"
    assert plan["step-300"]["action"] == "skip" and plan["step-300"]["status"] == "unknown"
    assert plan["step-250"]["action"] == "delete" and "abandoned" in plan["step-250"]["reason"]
    assert "abandoned" not in plan["step-100"]["reason"]  # older: by policy, within its own layout
    names = tree_names(root)
    assert {"step-200", "step-300", "step-0000000001"} <= set(names)
    assert "step-250" not in names


# --- torchtitan / DCP ------------------------------------------------------------------------


def test_dcp_root_ls_latest_verify(tmp_path):
    root = str(tmp_path)
    for s in (10, 20):
        dcp_step(root, s)
    dcp_step(root, 30, complete=False)
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    assert {n: (e.layout, e.status) for n, e in rows.items()} == {
        "step-10": ("dcp", "committed"), "step-20": ("dcp", "committed"), "step-30": ("dcp", "partial")}
    assert ".metadata" in rows["step-30"].reason
    r = cli("ls", root, "--json")
    assert r.exit_code == 0 and {x["name"]: x["layout"] for x in r.json()["checkpoints"]} == {
        "step-10": "dcp", "step-20": "dcp", "step-30": "dcp"}
    best = latest_checkpoint(open_storage(root), "load")
    assert best.step == 20 and best.report.url.endswith("step-20") and "load_step 20" in best.resume.option
    # a record's file truncated: step 20 fails, latest falls back to step 10
    distcp = sorted(n for n in os.listdir(os.path.join(root, "step-20")) if n.endswith(".distcp"))[0]
    with open(os.path.join(root, "step-20", distcp), "r+b") as f:
        f.truncate(10)
    best = latest_checkpoint(open_storage(root), "quick")
    assert best.step == 10 and best.skipped and "past the end" in str(best.skipped[0].problems[0])
    reports = verify_root(open_storage(root), which="all", level="load")
    assert [(r.step, r.ok) for r in reports] == [(20, False), (10, True)]


# --- Hugging Face Trainer (transformers/trainer.py, Trainer._save_checkpoint) ---------------


def hf_checkpoint(root: str, step: int, *, best: str | None = None, state: bool = True, optimizer: bool = True) -> str:
    """``checkpoint-{global_step}`` as ``_save_checkpoint`` writes it: model, training args,
    optimizer and scheduler, RNG state (numpy's included), and ``trainer_state.json`` last.
    ``optimizer=False``: as with ``save_only_model=True`` (no optimizer, scheduler or RNG state)."""
    import numpy as np
    from safetensors.torch import save_file

    path = os.path.join(root, f"checkpoint-{step}")
    os.makedirs(path)
    save_file({"w": torch.randn(8, 8)}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2"}, f)
    torch.save(argparse.Namespace(lr=1.0), os.path.join(path, "training_args.bin"))  # a pickle of a class
    if optimizer:
        torch.save({"state": {0: {"exp_avg": torch.zeros(8)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
                   os.path.join(path, "optimizer.pt"))
        torch.save({"last_epoch": step, "_last_lr": [1e-3]}, os.path.join(path, "scheduler.pt"))
        torch.save({"python": (3, tuple(range(5)), None), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
                   os.path.join(path, "rng_state.pth"))
    if state:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step, "best_model_checkpoint": best, "log_history": []}, f)
    return path


def test_hf_trainer_commit_rule_load_level_and_best_checkpoint(tmp_path):
    root = str(tmp_path)
    for s in (100, 200, 300, 400):
        hf_checkpoint(root, s, best=os.path.join(root, "checkpoint-100"))
    os.unlink(os.path.join(root, "checkpoint-400", "trainer_state.json"))  # killed mid-save
    rows = {e.name: (e.layout, e.status) for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["checkpoint-400"] == ("hf-trainer", "partial") and rows["checkpoint-300"] == ("hf-trainer", "committed")
    best = latest_checkpoint(open_storage(root), "load")
    assert best.step == 300 and "--resume_from_checkpoint" in best.resume.option
    assert "training_args.bin: decoded structurally" in (best.report.note or "")  # opcodes walked, never run
    # a truncated optimizer.pt is caught (issue 12: `verify` passed it, reading model.safetensors only)
    opt = os.path.join(root, "checkpoint-300", "optimizer.pt")
    with open(opt, "r+b") as f:
        f.truncate(os.path.getsize(opt) // 2)
    r = cli("verify", os.path.join(root, "checkpoint-300"), "--json")
    assert r.exit_code == 1 and "optimizer.pt" in r.stdout
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 1, r.stdout  # the broken newest is reported, left in place
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["checkpoint-100"]["action"] == "keep" and "best_model_checkpoint" in plan["checkpoint-100"]["reason"]
    assert plan["checkpoint-200"]["action"] == "keep"  # the anchor
    assert os.path.isdir(os.path.join(root, "checkpoint-100"))


def test_hf_global_step_must_agree(tmp_path):
    root = str(tmp_path)
    path = hf_checkpoint(root, 5)
    shutil.move(path, os.path.join(root, "checkpoint-6"))  # renamed by hand
    (entry,) = catalog.list_checkpoints(open_storage(root))
    assert entry.status == "corrupt" and "global_step 5" in (entry.reason or "")


# --- Megatron-LM (megatron/training/checkpointing.py, save_checkpoint) -----------------------


def megatron_iter(root: str, it: int, *, tracker: bool = True, optimizer: bool = True) -> str:
    """Legacy layout: ``iter_{:07d}/mp_rank_00/model_optim_rng.pt`` (with ``args``, an
    argparse.Namespace, and ``optimizer`` unless ``--no-save-optim``: ``optimizer=False``),
    then rank 0 writes the tracker after the barrier."""
    import numpy as np

    path = os.path.join(root, f"iter_{it:07d}", "mp_rank_00")
    os.makedirs(path)
    doc = {"args": argparse.Namespace(hidden_size=8), "iteration": it, "checkpoint_version": 3.0,
           "model": {"w": torch.ones(4)}, "rng_state": [{"np_rng_state": np.random.get_state()}]}
    if optimizer:
        doc["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}
    torch.save(doc, os.path.join(path, "model_optim_rng.pt"))
    if tracker:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(it))
    return os.path.dirname(path)


def test_megatron_tracker_is_the_commit_and_integrity_json(tmp_path):
    root = str(tmp_path)
    megatron_iter(root, 1000)
    megatron_iter(root, 2000)
    megatron_iter(root, 3000, tracker=False)  # killed before the tracker
    rows = {e.step: e.status for e in catalog.list_checkpoints(open_storage(root))}
    assert rows == {1000: "committed", 2000: "committed", 3000: "partial"}
    best = latest_checkpoint(open_storage(root), "load", formats=["megatron"])
    assert best.step == 2000 and best.resume.option == f"--load {root}" and not best.report.problems
    # integrity.json: a changed byte is caught at the checksums level
    it = os.path.join(root, "iter_0002000")
    pt = os.path.join(it, "mp_rank_00", "model_optim_rng.pt")
    import hashlib
    with open(os.path.join(it, "integrity.json"), "w") as f:
        json.dump({"mp_rank_00/model_optim_rng.pt": hashlib.sha256(open(pt, "rb").read()).hexdigest()}, f)
    flip(pt, os.path.getsize(pt) // 2)
    best = latest_checkpoint(open_storage(root), "checksums")
    assert best.step == 1000 and "--ckpt-step 1000" in best.resume.option
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["iter_0002000"]["action"] == "skip"  # broken, newer than the anchor, tracker's target
    assert os.path.isdir(it)


# --- DeepSpeed (deepspeed/runtime/engine.py, DeepSpeedEngine.save_checkpoint) ---------------


def deepspeed_tag(root: str, step: int, *, dp: int = 2, latest: bool = True) -> str:
    """``global_step{N}/mp_rank_00_model_states.pt`` and one
    ``zero_pp_rank_{D}_mp_rank_00_optim_states.pt`` per data-parallel rank, then ``latest``."""
    path = os.path.join(root, f"global_step{step}")
    os.makedirs(path)
    torch.save({"module": {"w": torch.ones(4)}, "global_steps": step, "ds_version": "0.19"},
               os.path.join(path, "mp_rank_00_model_states.pt"))
    for d in range(dp):
        torch.save({"optimizer_state_dict": {"zero_stage": 2}, "ds_version": "0.19"},
                   os.path.join(path, f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt"))
    if latest:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(f"global_step{step}")
    return path


def test_deepspeed_latest_zero_byte_files_and_protection(tmp_path):
    root = str(tmp_path)
    for s in (10, 20, 30):
        deepspeed_tag(root, s)
    # power loss after `latest` (written before DeepSpeed's final barrier): a 0-byte rank file
    open(os.path.join(root, "global_step30", "zero_pp_rank_1_mp_rank_00_optim_states.pt"), "wb").close()
    deepspeed_tag(root, 40, latest=False)  # newer than `latest`: not finished
    rows = {e.step: e.status for e in catalog.list_checkpoints(open_storage(root))}
    assert rows == {10: "committed", 20: "committed", 30: "committed", 40: "partial"}
    best = latest_checkpoint(open_storage(root), "load")
    assert best.step == 20 and "0 bytes" in str(best.skipped[0].problems[0])
    assert "tag='global_step20'" in best.resume.option
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["global_step10"]["action"] == "delete" and plan["global_step20"]["action"] == "keep"
    assert plan["global_step30"]["action"] == "skip"  # broken newest: the pointer target stays
    assert plan["global_step40"]["action"] == "delete"
    assert tree_names(root) == ["global_step20", "global_step30", "latest"]


def test_deepspeed_without_latest_is_never_taken_for_abandoned(tmp_path):
    root = str(tmp_path)
    deepspeed_tag(root, 10, latest=False)
    _age(os.path.join(root, "global_step10"), 7 * HOURS)
    (entry,) = catalog.list_checkpoints(open_storage(root))
    assert entry.status == "corrupt" and "latest" in (entry.reason or "")
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes")
    assert r.exit_code == 1 and os.path.isdir(os.path.join(root, "global_step10"))


def test_pickle_beyond_the_allow_list_is_decoded_structurally_never_run(tmp_path):
    """Not test-loaded (torch refuses the class), decoded structurally instead: a class name
    alone fails nothing, and the report names it."""
    root = str(tmp_path)
    path = deepspeed_tag(root, 10)
    torch.save({"module": {"w": torch.ones(2)}, "cfg": _Custom()}, os.path.join(path, "mp_rank_00_model_states.pt"))
    assert latest_checkpoint(open_storage(root), "load").step == 10
    (report,) = verify_root(open_storage(root), which="all", level="load")
    assert report.ok and "_Custom" in (report.note or "") and "never unpickled" in (report.note or ""), report


class _Custom:
    """A class no allow-list names: its pickle must never be run."""


def test_man_page_names_every_layout_and_its_source():
    page = open(os.path.join(os.path.dirname(__file__), "..", "man", "ckptctl-layouts.7")).read().replace("\\-", "-")
    sources = {"dcp": "torch/distributed/checkpoint/filesystem.py", "hf-trainer": "transformers/trainer.py",
               "megatron": "megatron/training/checkpointing.py", "deepspeed": "deepspeed/runtime/engine.py",
               "lightning": "lightning/pytorch/callbacks/model_checkpoint.py"}
    for fmt in (layout.name for layout in catalog.BUILTIN):  # a plugin's layout is its own package's to document
        assert f"\n{fmt} " in page or f"\n.B {fmt}\n" in page, fmt
    for fmt, source in sources.items():
        assert source in page, (fmt, source)


_KILLED_SAVE = r"""
import os, sys, time, warnings
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

class HangsBeforeMetadata(FileSystemWriter):
    # DCP's own writer: every record is written; then the process hangs where .metadata comes.
    def finish(self, metadata, results):
        open(sys.argv[2], "w").close()
        time.sleep(600)

warnings.simplefilter("ignore")
dcp.save({"model": {"w": torch.ones(256)}}, storage_writer=HangsBeforeMetadata(sys.argv[1]))
"""


def test_dcp_save_killed_before_metadata(tmp_path):
    import signal
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    dcp_step(root, 10)
    flag = str(tmp_path / "records-written")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, os.path.join(root, "step-20"), flag])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag):
            assert proc.poll() is None and time.monotonic() < deadline, "the save never reached .metadata"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = os.listdir(os.path.join(root, "step-20"))
    assert any(n.endswith(".distcp") for n in left) and ".metadata" not in left
    rows = {e.name: e.status for e in catalog.list_checkpoints(open_storage(root))}
    assert rows == {"step-10": "committed", "step-20": "partial"}
    r = cli("latest", root, "--format", "dcp")
    assert r.exit_code == 0 and r.stdout.strip() == os.path.join(root, "step-10")
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")  # fresh: may still be written
    assert r.exit_code == 0 and os.path.isdir(os.path.join(root, "step-20"))
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0 and tree_names(root) == ["step-10"]


def test_levels_on_a_trainer_checkpoint_quick_sizes_default_crc(tmp_path):
    root = str(tmp_path)
    path = hf_checkpoint(root, 10)
    opt = os.path.join(path, "optimizer.pt")
    import zipfile
    with zipfile.ZipFile(opt) as z:  # a byte inside a tensor record: same size, zip directory intact
        rec = next(i for i in z.infolist() if "/data/" in i.filename)
    with open(opt, "rb") as f:  # the record's data follows its local header (whose padding torch sizes)
        f.seek(rec.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    flip(opt, rec.header_offset + 30 + name_len + extra_len + rec.file_size // 2)
    quick = cli("verify", path, "--quick", "--json")
    assert quick.exit_code == 0, quick.stdout  # presence, sizes, headers: all fine
    full = cli("verify", path, "--json")
    assert full.exit_code == 1 and "CRC-32" in full.stdout and "optimizer.pt" in full.stdout


def test_a_delete_takes_the_commit_file_first():
    from ckptctl.layouts.dcp import DcpLayout
    from ckptctl.layouts.hf_trainer import HfTrainerLayout

    assert DcpLayout().removal_order(["__0_0.distcp", "z.distcp", ".metadata"])[0] == ".metadata"
    assert HfTrainerLayout().removal_order(["config.json", "trainer_state.json", "a.pt"])[0] == "trainer_state.json"


def test_a_cut_dcp_data_file_is_named_once_with_what_to_do(tmp_path):
    root = str(tmp_path)
    path = dcp_step(root, 30)
    data = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    problem = cli("verify", path, "--json").json()["checkpoints"][0]["problems"][0]
    assert problem["file"] == ".metadata" and not problem["message"].startswith(path)  # the file, named once
    assert os.path.basename(data) in problem["message"] and "cut short" in problem["hint"]
