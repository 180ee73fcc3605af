"""A real TRL run (``SFTTrainer`` with ``SFTConfig``, the ``.[frameworks]`` extra): one verdict
per checkpoint (issue 28).

TRL's ``SFTConfig`` subclasses the Trainer's ``TrainingArguments``, so ``training_args.bin``
pickles a class no allow-list names. The Trainer never reads that file on resume: ``verify
--load`` of the newest checkpoint passes (the file decoded structurally, its class named,
never unpickled), and ``prune --keep-last 1`` keeps exactly the newest; before, prune called
every checkpoint broken, deleted nothing and exited 1, every night.

The run is a tiny Llama built from a config (no download), a word-level tokenizer built in
memory, 16 rows of text, three steps saved after each, on CPU, once per module in a
subprocess (TRL's import takes seconds: it stays out of the test worker).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest

from helpers import cli

_SFT_RUN = r"""
import os, sys
os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true")
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                     pad_token_id=0, eos_token_id=1, bos_token_id=1))
data = Dataset.from_dict({"text": [" ".join(f"w{(i * 7 + j) % 61}" for j in range(12)) for i in range(16)]})
args = SFTConfig(output_dir=sys.argv[1], max_steps=3, save_steps=1, save_strategy="steps", per_device_train_batch_size=4,
                 max_length=16, report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True,
                 dataloader_num_workers=0, seed=0)
SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
"""


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The output directory of one real SFTTrainer run: checkpoint-1, -2 and -3."""
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[frameworks]')")
    out = str(tmp_path_factory.mktemp("sft") / "run")
    done = subprocess.run([sys.executable, "-c", _SFT_RUN, out], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == \
        ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    return out


def _copy(run: str, to: str) -> str:
    shutil.copytree(run, to)
    return to


def test_verify_load_of_an_sft_checkpoint_passes_and_names_its_config(sft_run: str) -> None:
    newest = os.path.join(sft_run, "checkpoint-3")
    r = cli("verify", newest, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    note = r.json()["checkpoints"][0]["note"]
    assert "training_args.bin: decoded structurally: names trl.trainer.sft_config.SFTConfig" in note, note
    assert "never unpickled" in note
    r = cli("latest", sft_run, "--level", "load")
    assert r.exit_code == 0 and r.stdout.strip() == newest, r.stdout + r.stderr


def test_prune_keep_last_1_of_an_sft_run_keeps_only_the_newest(sft_run: str, tmp_path) -> None:
    root = _copy(sft_run, str(tmp_path / "run"))
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == ["checkpoint-3"]
    assert r.json()["plan"]["anchor"]["name"] == "checkpoint-3"


class _NobodyKnows:
    """A class no allow-list names, pickled by plain pickle.dump (protocol 5): never run."""

    def __init__(self) -> None:
        self.lr, self.names = 0.5, ["a", "b"]


def test_a_protocol_5_pickle_of_an_unknown_class_decodes_structurally(sft_run: str, tmp_path) -> None:
    root = _copy(sft_run, str(tmp_path / "run"))
    newest = os.path.join(root, "checkpoint-3")
    with open(os.path.join(newest, "training_args.bin"), "wb") as f:
        pickle.dump(_NobodyKnows(), f, protocol=5)
    r = cli("verify", newest, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "_NobodyKnows; never unpickled" in r.json()["checkpoints"][0]["note"]


def test_what_the_trainer_never_reads_on_resume_is_reported_never_broken(sft_run: str, tmp_path) -> None:
    """A zeroed training_args.bin: reported by verify at every level, and prune still anchors on
    its checkpoint (the Trainer resumes it); a zeroed optimizer.pt, which it reads, breaks it."""
    root = _copy(sft_run, str(tmp_path / "run"))
    newest = os.path.join(root, "checkpoint-3")
    args = os.path.join(newest, "training_args.bin")
    with open(args, "r+b") as f:
        f.write(bytes(os.path.getsize(args)))
    r = cli("verify", newest, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "training_args.bin: not decoded" in r.json()["checkpoints"][0]["note"]
    assert cli("prune", root, "--keep-last", "1", "--dry-run", "--json").json()["plan"]["anchor"]["name"] == "checkpoint-3"
    optimizer = os.path.join(newest, "optimizer.pt")
    with open(optimizer, "r+b") as f:
        f.write(bytes(os.path.getsize(optimizer)))
    assert cli("verify", newest, "--load").exit_code == 1
    plan = cli("prune", root, "--keep-last", "1", "--dry-run", "--json").json()["plan"]
    assert plan["anchor"]["name"] == "checkpoint-2"
