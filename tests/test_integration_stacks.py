"""``ckptctl.integrations`` inside real runs of the Hugging Face Trainer, TRL's ``SFTTrainer``,
Lightning and accelerate (the ``.[frameworks]`` extra; tiny models from configs, CPU, no hub).

Each stack's job (``integration_stack_jobs``) runs once, in its own process, and is SIGKILLed in
the middle of its last save. Then, as a launcher and an operator would: ``ckptctl verify ROOT
--latest`` passes on what the integration wrote; ``latest`` never names the save that was
killed; one flipped bit in a data file of the newest checkpoint makes ``verify`` exit 1 naming
the file, and Lightning's ``CheckpointIO`` refuses to load it before the model changes. One test
per job, so that no job runs twice under pytest-xdist.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from ckptctl.format.seal import SEAL, parse_seal
from helpers import cli

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(job: str, out: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(HERE, "integration_stack_jobs.py"), job, out],
                          capture_output=True, text=True, timeout=400)


def _seal(ckpt: str):  # type: ignore[no-untyped-def]
    with open(os.path.join(ckpt, SEAL), "rb") as f:
        return parse_seal(f.read(), SEAL)


def _data_offset(path: str) -> int:
    """Where to flip a bit so that it lands in tensor bytes: the middle of the largest record of
    a ``torch.save`` archive (its zip headers and padding are not covered by the records'
    CRC-32s, all a one-file checkpoint has), or three quarters into any other file (a
    safetensors file's tensors come after its small header)."""
    if not zipfile.is_zipfile(path):
        return os.path.getsize(path) * 3 // 4
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def _flip_in_data(path: str) -> None:
    at = _data_offset(path)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x04]))


def _statuses(root: str) -> dict[str, str]:
    return {e["name"]: e["status"] for e in json.loads(cli("ls", root, "--json").stdout)["checkpoints"]}


def _verify_latest_ok(root: str, name: str) -> None:
    got = cli("verify", root, "--latest")
    assert got.exit_code == 0, got.stdout + got.stderr
    assert name in got.stdout + got.stderr
    latest = cli("latest", root)
    assert latest.exit_code == 0 and latest.stdout.strip().endswith(name), latest.stdout + latest.stderr


def _flip_fails_verify(ckpt: str, data_file: str = "") -> None:
    """Flip a bit in ``data_file`` of the checkpoint ``ckpt`` (the checkpoint itself when it is
    one file): ``verify`` must exit 1 naming the file."""
    _flip_in_data(os.path.join(ckpt, data_file) if data_file else ckpt)
    got = cli("verify", ckpt)
    assert got.exit_code == 1, got.stdout + got.stderr
    assert (data_file or os.path.basename(ckpt)) in got.stdout + got.stderr


def test_trainer_and_trl_sft_trainer_seal_each_checkpoint_and_retention_keeps_best_and_last(tmp_path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[frameworks]')")
    done = _run("trainers", str(tmp_path))
    assert done.returncode == -9, done.stderr[-3000:]

    # The Trainer: every checkpoint sealed, retention (best 1 of eval_score | last 1) applied.
    root = str(tmp_path / "trainer")
    assert _statuses(root) == {"checkpoint-2": "committed", "checkpoint-8": "committed"}  # 4 and 6 pruned
    for name in ("checkpoint-2", "checkpoint-8"):
        seal = _seal(os.path.join(root, name))
        assert seal.layout == "hf-trainer" and seal.test_loaded == "written"
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= {f.name for f in seal.files}
    _verify_latest_ok(root, "checkpoint-8")
    _flip_fails_verify(os.path.join(root, "checkpoint-8"), "model.safetensors")  # safetensors has no checksum of its own

    # TRL's SFTTrainer, killed in its save of step 6: the sealed step 4 is what resumes.
    root = str(tmp_path / "trl")
    assert _statuses(root) == {"checkpoint-2": "committed", "checkpoint-4": "committed", "checkpoint-6": "partial"}
    assert _seal(os.path.join(root, "checkpoint-4")).step == 4
    _verify_latest_ok(root, "checkpoint-4")
    _flip_fails_verify(os.path.join(root, "checkpoint-4"), "model.safetensors")


def test_accelerate_save_state_is_sealed_pruned_and_a_killed_save_is_not_taken(tmp_path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[frameworks]')")
    done = _run("accelerate", str(tmp_path))
    assert done.returncode == -9, done.stderr[-3000:]
    root = str(tmp_path / "checkpoints")
    # checkpoint_0 pruned by KeepLast(2) once checkpoint_2 was sealed; checkpoint_3 was killed.
    assert _statuses(root) == {"checkpoint_1": "committed", "checkpoint_2": "committed", "checkpoint_3": "partial"}
    assert _seal(os.path.join(root, "checkpoint_2")).layout == "accelerate"
    _verify_latest_ok(root, "checkpoint_2")
    _flip_fails_verify(os.path.join(root, "checkpoint_2"), "model.safetensors")


def test_lightning_checkpoint_io_async_atomic_retention_safe_and_refuses_a_damaged_file(tmp_path) -> None:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")
    done = _run("lightning", str(tmp_path))
    assert done.returncode == -9, done.stderr[-3000:]
    names = sorted(os.listdir(tmp_path))
    # Step 8 was cut after 4096 bytes: only its hidden temporary exists, never a cut .ckpt; and
    # save_top_k=2 did not remove step 4 before step 8 was durable.
    assert [n for n in names if not n.startswith(".")] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"], names
    assert any(n.startswith(".epoch=0-step=8.ckpt.tmp-") for n in names), names
    _verify_latest_ok(str(tmp_path), "epoch=0-step=6.ckpt")

    import lightning.pytorch as pl

    from ckptctl.errors import InvalidCheckpoint
    from ckptctl.integrations.lightning import CheckpointIO
    from integration_stack_jobs import lightning_data, lightning_module

    newest = str(tmp_path / "epoch=0-step=6.ckpt")
    model = lightning_module()()
    state = CheckpointIO().load_checkpoint(newest)  # a good file loads, with weights_only=True
    assert state["global_step"] == 6 and "optimizer_states" in state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _flip_fails_verify(newest)
    trainer = pl.Trainer(max_steps=10, plugins=[CheckpointIO()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.raises(InvalidCheckpoint, match="epoch=0-step=6.ckpt"):
        trainer.fit(model, lightning_data(), ckpt_path=newest)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model changed"


def test_trainer_and_accelerate_hash_what_torch_save_and_safetensors_wrote_during_the_save_and_read_it_once(tmp_path) -> None:
    """The files the stacks write with ``torch.save`` and safetensors are hashed as each is
    closed, while the save goes on: the process reads each of them once before the save is
    over, and the seal written after reads them no more (under a tenth of their bytes are read
    then: the small JSON files no hook saw). A seal that reads the checkpoint back after the
    save reads everything then. The seal holds the bytes on disk: ``verify`` passes, and one
    flipped bit in the optimizer's file fails it."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[frameworks]')")
    done = subprocess.run([sys.executable, os.path.join(HERE, "integration_stack_jobs.py"), "reads", str(tmp_path)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    expect = {"trainer": ({"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"},
                          "optimizer.pt"),
              "accelerate": ({"model.safetensors", "optimizer.bin", "random_states_0.pkl"}, "optimizer.bin")}
    for stack, (hooked, optimizer) in expect.items():
        run = got[stack]
        written = sum(run["sizes"][name] for name in hooked)
        assert written > 4 << 20, run  # a few MiB: far above what the JSON files and the seal's own work read
        assert written <= run["during"] < written * 1.1, f"{stack}: {run['during']} bytes read during the save of {written}"
        assert run["after"] < written // 10, f"{stack}: {run['after']} bytes read after the save of {written}"
        assert set(run["during_save"]) == hooked and not set(run["after_save"]) & hooked, run
        ckpt = run["path"]
        ok = cli("verify", ckpt)
        assert ok.exit_code == 0, ok.stdout + ok.stderr
        _flip_fails_verify(ckpt, optimizer)
