"""Training jobs for tests/test_integration_stacks.py, each run as its own process and each
SIGKILLed in the middle of its last save (after the previous checkpoint's seal is written):
``python integration_stack_jobs.py JOB OUT``.

- ``trainers``: the Hugging Face ``Trainer`` (tiny GPT-2 from a config) with ``SealCallback``
  and a retention policy, 8 steps, saving every 2; then TRL's ``SFTTrainer`` with
  ``SealCallback``, killed in its save of step 6 (after the model, before the RNG state and
  ``trainer_state.json``, the Trainer's commit file);
- ``lightning``: ``ModelCheckpoint`` (every 2 steps, ``save_top_k=2``) through the asynchronous
  ``CheckpointIO``, killed after 4096 bytes of the step-8 file are written;
- ``accelerate``: ``save_state`` with ``seal_saves`` and ``KeepLast(2)``, killed in the fourth
  save (after the model and optimizer, before the scheduler and RNG files).

One job is not killed: ``reads`` saves twice with the Trainer's ``SealCallback`` and twice with
``seal_saves`` (models of a few MiB) and prints, as JSON, how many bytes this process read
(``rchar`` of ``/proc/self/io``) during the second save (until the files it closed are hashed)
and after it (until its seal is written), with the sizes of the checkpoint's files and when
the seal's checksum of each was taken.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def trainers(out: str) -> None:
    sys.path.insert(0, HERE)
    from test_frameworks import _tiny_trainer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from ckptctl import KeepBest, KeepLast
    from ckptctl.integrations.trainer import SealCallback

    trainer = _tiny_trainer(os.path.join(out, "trainer"))
    trainer.add_callback(SealCallback(retention=KeepBest(1, "eval_score", mode="max") | KeepLast(1)))
    trainer.train()

    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       eos_token_id=61, bos_token_id=61, pad_token_id=60))
    data = Dataset.from_dict({"text": [" ".join(f"w{(i * 7 + j) % 60}" for j in range(12)) for i in range(16)]})
    callback = SealCallback()

    class DiesInSave(SFTTrainer):
        def _save_rng_state(self, output_dir):  # type: ignore[no-untyped-def]
            if self.state.global_step == 6:
                callback.sealer.wait()  # checkpoint-4's seal is on disk: the kill is in step 6's save
                _die()
            super()._save_rng_state(output_dir)

    args = SFTConfig(output_dir=os.path.join(out, "trl"), max_steps=6, save_steps=2, per_device_train_batch_size=4,
                     report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True, max_length=32,
                     dataloader_num_workers=0, seed=0)
    DiesInSave(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[callback]).train()


def lightning_module():  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.log("progress", float(self.global_step))
            return ((self.layer(x) - y) ** 2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny


def lightning_data():  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def lightning(out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    import ckptctl.integrations.lightning as integration
    from ckptctl.integrations.stream import StorageStream

    class DiesMidWrite(StorageStream):
        files = 0  # the fourth file is step 8's

        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            DiesMidWrite.files += 1
            self.last = DiesMidWrite.files == 4

        def write(self, data):  # type: ignore[no-untyped-def]
            n = super().write(data)
            if self.last and self.tell() > 4096:
                self._hand_on()  # bytes on disk under the temporary name, then the kill
                _die()
            return n

    integration.StorageStream = DiesMidWrite  # type: ignore[misc]
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=8, plugins=[integration.CheckpointIO(asynchronous=True)], logger=False,
                         callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=2, monitor="progress",
                                                    mode="max")],
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(lightning_module()(), lightning_data())


def accelerate(out: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    from ckptctl import KeepLast
    from ckptctl.integrations.accelerate import seal_saves

    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True))
    sealing = seal_saves(acc, retention=KeepLast(2))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    model, opt, sched, dl = acc.prepare(model, opt, sched, torch.utils.data.DataLoader(ds, batch_size=4))
    for epoch in range(4):
        for x, y in dl:
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
        sched.step()
        if epoch == 3:
            sealing.sealer.wait()  # checkpoint_2's seal and retention are done: the kill is in this save
            sched.state_dict = _die  # type: ignore[method-assign]  # after model and optimizer are written
        acc.save_state()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _measured(ckpt: str, reads: tuple[int, int, int], sealer) -> dict:  # type: ignore[no-untyped-def]
    start, saved, sealed = reads
    sources = getattr(sealer, "sources", {}).get(ckpt)  # none: a sealer that hashes every file after the save
    names = sorted(n for n in os.listdir(ckpt) if n != ".ckptctl-seal.json")
    during = sources.during_save if sources is not None else []
    return {"path": ckpt, "during": saved - start, "after": sealed - saved, "during_save": during,
            "after_save": [n for n in names if n not in during],
            "sizes": {name: os.path.getsize(os.path.join(ckpt, name)) for name in names}}


def _hashed(hook) -> None:  # type: ignore[no-untyped-def]
    """Wait for the files the last save closed to be hashed (nothing to wait for without the hook)."""
    written = getattr(hook, "written", None)
    if written is not None:
        written.wait()


def reads(out: str) -> None:
    import json

    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ckptctl.integrations.accelerate import seal_saves
    from ckptctl.integrations.trainer import SealCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=512, n_positions=32))
    data = [{"input_ids": torch.randint(0, 512, (16,))} for _ in range(8)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    sealing = SealCallback()
    reads: dict[int, list[int]] = {}

    class Before(TrainerCallback):
        """Runs before ``SealCallback``: from the step's end (the Trainer saves next) to its save done."""

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            reads[state.global_step] = [_rchar()]

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            _hashed(sealing)
            reads[state.global_step].append(_rchar())

    class After(TrainerCallback):
        """Runs after ``SealCallback``: to the checkpoint sealed."""

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            sealing.sealer.wait()
            reads[state.global_step].append(_rchar())

    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), max_steps=4, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=100,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Before(), sealing, After()]).train()
    result = {"trainer": _measured(os.path.join(out, "trainer", "checkpoint-4"), tuple(reads[4]), sealing.sealer)}

    acc = Accelerator(cpu=True)
    hooked = seal_saves(acc)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = acc.prepare(net, opt)
    acc.backward(net(torch.randint(0, 2, (4, 512)).float()).sum())
    opt.step()
    for i in range(2):  # the first save imports what saving needs: the second is measured
        start = _rchar()
        acc.save_state(os.path.join(out, "accelerate", f"checkpoint_{i}"))
        _hashed(hooked)
        saved = _rchar()
        hooked.sealer.wait()
        measured = (start, saved, _rchar())
    hooked.close()
    result["accelerate"] = _measured(os.path.join(out, "accelerate", "checkpoint_1"), measured, hooked.sealer)
    print(json.dumps(result))


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    {"trainers": trainers, "lightning": lightning, "accelerate": accelerate, "reads": reads}[sys.argv[1]](sys.argv[2])
