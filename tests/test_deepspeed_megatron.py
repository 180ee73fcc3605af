"""DeepSpeed and megatron-core, run for real on CPU: each saves its own checkpoints, the newest
one is damaged while the stack's pointer still names it, and the framework's own loader
resumes from the argv ``ckptctl latest --resume-args`` printed (resume-truth issue, #20).

- DeepSpeed (``DS_ACCELERATOR=cpu``, gloo, 2 real ranks, ZeRO stage 2): ``save_checkpoint``
  three times, one byte flipped inside a tensor record of the newest tag's model states (its
  ``latest`` file still names it). ``verify ROOT --latest`` must fail naming ``latest``;
  ``latest --resume-args`` must name the older tag; a fresh engine's
  ``load_checkpoint(load_dir, tag=tag)`` with exactly those arguments must give back, bitwise,
  the weights, fp32 master partition and Adam state each rank held when that tag was saved.
- megatron-core (gloo, 1 rank): ``dist_checkpointing.save`` of a sharded state dict laid out as
  Megatron-LM's ``save_checkpoint`` lays it out (``iter_{:07d}`` directories, the tracker
  written after the save), the newest iteration's data file cut short. ``latest
  --resume-args`` must pin the older iteration (``--load ROOT --ckpt-step N``), and
  ``dist_checkpointing.load`` of the directory Megatron-LM builds from those arguments must
  give back the tensors saved there.

Both also check that ckptctl's load level decodes the real files (``verify --load`` exits 0);
the DeepSpeed class that needed an allow-list entry (``fragment_address``) is also tested
without DeepSpeed, beside a class that must still fail. The ranks are real processes running
this file as a script (``python THIS ROLE ...``); the two framework tests skip, naming the
package, where it is not installed (``pip install -e '.[frameworks]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile

import pytest

DS_STEPS = 3
MEGATRON_ITERS = (10, 20, 30)
TRACKER = "latest_checkpointed_iteration.txt"


def _needs(module: str, package: str) -> None:
    # find_spec, not importorskip: the frameworks run in the rank processes only, so importing
    # them here (DeepSpeed probes accelerators at import) would only slow the test session.
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        found = False
    if not found:
        pytest.skip(f"{package} is not installed (pip install -e '.[frameworks]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(role: str, world_size: int, out: str, *extra: str, timeout: float = 180) -> list[dict]:
    """Run ``role`` of this file on ``world_size`` real processes (env:// rendezvous, as a
    launcher sets it up); returns each rank's result JSON, or fails with its output."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        with open(os.path.join(out, f"{role}.rank{rank}.log"), "wb") as log:  # a file: no pipe to drain
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), role, out, *extra], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            pytest.fail(f"{role}: a rank did not finish in {timeout:.0f} s:\n{_log(out, role, 0)}")
    results = []
    for rank, p in enumerate(procs):
        path = os.path.join(out, f"{role}.rank{rank}.json")
        assert p.returncode == 0 and os.path.exists(path), f"{role} rank {rank} exited {p.returncode}:\n{_log(out, role, rank)}"
        with open(path) as f:
            results.append(json.load(f))
    return results


def _log(out: str, role: str, rank: int) -> str:
    with open(os.path.join(out, f"{role}.rank{rank}.log"), errors="replace") as f:
        return f.read()[-4000:]


def _flip_in_record(path: str) -> str:
    """Flip one byte in the middle of the largest tensor record of a ``torch.save`` zip archive
    (``ARCHIVE/data/N``: a tensor's bytes, as bit rot leaves it); the archive's structure stays
    whole, only that record's CRC-32 breaks. Returns the record's name."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if i.filename.split("/")[-2:-1] == ["data"]), key=lambda i: i.compress_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return info.filename


# --- DeepSpeed -------------------------------------------------------------------------------


def test_deepspeed_zero2_resumes_the_tag_resume_args_names_after_a_corrupt_newest(tmp_path):
    _needs("deepspeed", "deepspeed")
    from helpers import cli
    from test_resume_args import _argv

    root, out = str(tmp_path / "ds"), str(tmp_path / "out")
    os.makedirs(out)
    saved = _ranks("ds-save", 2, out, root)
    assert all(r["tags"] == [f"global_step{s}" for s in range(1, DS_STEPS + 1)] for r in saved), saved
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == f"global_step{DS_STEPS}"  # DeepSpeed's pointer names the newest
    good, bad = os.path.join(root, f"global_step{DS_STEPS - 1}"), os.path.join(root, f"global_step{DS_STEPS}")
    assert sorted(os.listdir(good)) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    # Real DeepSpeed files pass the load level: every record decoded (test-loaded, or its
    # pickle decoded structurally against the DeepSpeed allow-list), none skipped.
    r = cli("verify", good, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["checkpoints"][0]["bytes_read"] > 0
    # inspect reads what verify does (main: "not a checkpoint", exit 1): the model states'
    # tensors as the model, ZeRO's partitions as the optimizer (by their records, never unpickled).
    r = cli("inspect", good, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert (doc["format"], doc["step"], doc["content"]) == ("deepspeed", DS_STEPS - 1, "resumable"), doc
    assert doc["bytes_by_group"]["model"] > 0 and doc["bytes_by_group"]["optimizer"] > doc["bytes_by_group"]["model"]

    _converts_the_model_weights(good, out, f"global_step{DS_STEPS - 1}")

    _flip_in_record(os.path.join(bad, "mp_rank_00_model_states.pt"))  # `latest` still names it

    # What `load_checkpoint(ROOT)` would load does not verify: exit 1, naming the pointer.
    r = cli("verify", root, "--latest", "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    (pointer,) = r.json()["pointers"]
    assert (pointer["pointer"], pointer["target"], pointer["ok"]) == ("latest", f"global_step{DS_STEPS}", False), pointer
    assert pointer["verifies"]["name"] == f"global_step{DS_STEPS - 1}", pointer
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1 and f"latest names global_step{DS_STEPS}, which does not verify" in r.stdout + r.stderr
    r = cli("latest", root)  # the root would resume the broken tag: nothing usable on stdout
    assert r.exit_code == 1 and r.stdout == "", r.stdout + r.stderr

    argv = _argv(root)
    assert argv == ["--load_dir", root, "--tag", f"global_step{DS_STEPS - 1}"]

    # The training script's side: its own argument parsing, then a fresh engine (other initial
    # weights) loads with exactly those arguments.
    loaded = _ranks("ds-load", 2, out, *argv)
    for rank, got in enumerate(loaded):
        assert got["differed_before_load"], got  # the fresh engine did not start equal
        assert got["tag"] == f"global_step{DS_STEPS - 1}" and got["global_steps"] == DS_STEPS - 1, got
        assert got["mismatches"] == [], f"rank {rank}: {got['mismatches']}"
        assert got["adam_steps"] == [DS_STEPS - 1], got


def _converts_the_model_weights(tag: str, out: str, name: str) -> None:
    """``convert`` of a real ZeRO-2 tag (main: exit 2) writes the model weights the engine
    held, bitwise, read from ``mp_rank_00_model_states.pt``'s ``module`` through the layout,
    and says that the ZeRO optimizer partitions were not converted."""
    import torch
    from safetensors.torch import load_file

    from helpers import cli

    module = {k[len("module."):]: v for k, v in torch.load(os.path.join(out, f"ds-ref.{name}.rank0.pt"),
                                                             weights_only=True).items() if k.startswith("module.")}
    dst = os.path.join(out, "weights.safetensors")
    r = cli("convert", tag, dst, "--to", "safetensors", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["step"] == DS_STEPS - 1 and doc["tensors"] == len(module), doc
    assert [d.split(":")[0] for d in doc["dropped"]] == [f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in (0, 1)]
    assert all("ZeRO optimizer partition" in d and "not converted" in d for d in doc["dropped"]), doc["dropped"]
    got = load_file(dst)
    assert sorted(got) == sorted(f"module/{k}" for k in module)
    assert all(torch.equal(got[f"module/{k}"], v) for k, v in module.items())
    r = cli("convert", tag, os.path.join(out, "as-ckptctl"), "--to", "ckptctl")  # a verified ckptctl checkpoint
    assert r.exit_code == 0 and "ZeRO optimizer partition" in r.stderr, r.stdout + r.stderr
    assert cli("verify", os.path.join(out, "as-ckptctl"), "--load").exit_code == 0


def test_deepspeed_convert_refuses_a_model_no_one_file_holds(tmp_path):
    """ZeRO-3 (``zero_pp_rank_D_mp_rank_00_model_states.pt``: the weights partitioned across the
    optimizer states) and tensor parallel tags (``mp_rank_01_...``): exit 2 naming the tag and
    DeepSpeed's consolidation script, nothing written."""
    from helpers import cli
    from test_layouts import deepspeed_tag

    zero3 = deepspeed_tag(str(tmp_path / "z3"), 5)
    os.rename(os.path.join(zero3, "mp_rank_00_model_states.pt"),
              os.path.join(zero3, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    tp = deepspeed_tag(str(tmp_path / "tp"), 5)
    shutil.copy(os.path.join(tp, "mp_rank_00_model_states.pt"), os.path.join(tp, "mp_rank_01_model_states.pt"))
    for tag, said in ((zero3, "a ZeRO-3 tag"), (tp, "a pipeline or tensor parallel tag (2 model states files)")):
        dst = str(tmp_path / "out.safetensors")
        r = cli("convert", tag, dst, "--to", "safetensors")
        assert r.exit_code == 2 and f"{tag}: {said}" in r.stderr and "zero_to_fp32.py" in r.stderr, r.stderr
        assert not os.path.exists(dst) and "Traceback" not in r.stderr
    for name in os.listdir(zero3):  # a save that wrote no model states yet: a checkpoint problem, exit 1
        os.unlink(os.path.join(zero3, name))
    r = cli("convert", zero3, str(tmp_path / "out.safetensors"), "--to", "safetensors")
    assert r.exit_code == 1 and "no *model_states.pt" in r.stderr, r.stderr


def _fake_deepspeed_module(monkeypatch):
    """``deepspeed.utils.tensor_fragment`` as far as pickle sees it (module and class names),
    without DeepSpeed: its ``fragment_address`` dataclass, and ``tensor_fragment``, a class the
    allow-list does not name."""
    import dataclasses
    import types

    mod = types.ModuleType("deepspeed.utils.tensor_fragment")

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 (DeepSpeed's name)
        numel: int
        start: int

    class tensor_fragment:  # noqa: N801
        pass

    for cls in (fragment_address, tensor_fragment):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    for name in ("deepspeed", "deepspeed.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_deepspeed_param_slice_mappings_pass_the_load_level_and_nothing_else_does(tmp_path, monkeypatch):
    """ZeRO-1/2 optimizer states hold ``param_slice_mappings`` of ``fragment_address``
    (found on real DeepSpeed 0.19 files): allowed, built as a plain namespace by torch's
    weights-only loader. A class beside it that the list does not name is decoded structurally
    (never run) and named: a class name alone fails nothing."""
    import collections

    import torch

    from helpers import cli
    from test_layouts import deepspeed_tag

    fake = _fake_deepspeed_module(monkeypatch)
    root = str(tmp_path)
    tag = deepspeed_tag(root, 10, dp=1)
    optim = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    mappings = [collections.OrderedDict({"0.weight": fake.fragment_address(numel=96, start=0),
                                         "0.bias": fake.fragment_address(numel=16, start=96)})]
    torch.save({"optimizer_state_dict": {"param_slice_mappings": mappings,
                                         "single_partition_of_fp32_groups": [torch.ones(112)]}, "ds_version": "0.19"},
               optim)
    r = cli("verify", tag, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    note = r.json()["checkpoints"][0]["note"] or ""
    assert "structurally" not in note, note  # test-loaded (weights-only, a namespace in its place)

    mappings[0]["0.weight"] = fake.tensor_fragment()  # a class nobody listed
    torch.save({"optimizer_state_dict": {"param_slice_mappings": mappings}, "ds_version": "0.19"}, optim)
    r = cli("verify", tag, "--load", "--json")
    assert r.exit_code == 0 and "tensor_fragment.tensor_fragment" in r.stdout, r.stdout + r.stderr
    assert "decoded structurally" in r.json()["checkpoints"][0]["note"]


_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},  # no op to compile
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1_000_000,
    "wall_clock_breakdown": False,
}


def _ds_engine(seed: int):
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (deepspeed.comm re-exports torch under that name)
    import torch

    # DeepSpeed JIT-compiles a shared-memory all-reduce kernel for the CPU accelerator (about a
    # minute, once per machine); it speeds up collectives only, so gloo does them here.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(_DS_CONFIG))
    return engine


def _ds_state(engine) -> dict:
    """What a resume must bring back on this rank: the module's weights, this rank's fp32
    master partition (ZeRO-2) and the Adam state over it."""
    import torch

    inner = engine.optimizer.optimizer  # the torch.optim.Adam over this rank's flat partition
    state = {f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    for i, t in enumerate(engine.optimizer.single_partition_of_fp32_groups):
        state[f"master.{i}"] = t.detach().clone()
    for i, p in enumerate(p for g in inner.param_groups for p in g["params"]):
        for k, v in inner.state.get(p, {}).items():
            state[f"adam.{i}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return state


def _ds_save(rank: int, out: str, root: str) -> dict:
    import torch

    engine = _ds_engine(seed=0)
    tags = []
    for step in range(1, DS_STEPS + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)  # each rank its own batch
        loss = engine(torch.randn(2, 6, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        tag = f"global_step{engine.global_steps}"
        engine.save_checkpoint(root)  # the default tag; rank 0 then writes `latest`
        torch.save(_ds_state(engine), os.path.join(out, f"ds-ref.{tag}.rank{rank}.pt"))
        tags.append(tag)
    return {"tags": tags}


def _ds_load(rank: int, out: str, *argv: str) -> dict:
    import torch

    parser = argparse.ArgumentParser()  # as a training script maps them to load_checkpoint
    parser.add_argument("--load_dir", required=True)
    parser.add_argument("--tag")
    args = parser.parse_args(argv)
    engine = _ds_engine(seed=1)  # fresh engine, other initial weights
    ref = torch.load(os.path.join(out, f"ds-ref.{args.tag}.rank{rank}.pt"), weights_only=True)
    fresh = _ds_state(engine)
    differed = any(not torch.equal(fresh[k], ref[k]) for k in ref if k.startswith("module."))
    path, _client = engine.load_checkpoint(args.load_dir, tag=args.tag)
    got = _ds_state(engine)
    mismatches = sorted(set(ref) ^ set(got)) + [
        k for k in sorted(set(ref) & set(got))
        if ref[k].dtype != got[k].dtype or ref[k].shape != got[k].shape or not torch.equal(ref[k], got[k])]
    steps = sorted({int(v.item()) for k, v in got.items() if k.endswith(".step")})
    return {"loaded": path, "tag": os.path.basename(os.path.dirname(path)) if path else None,
            "global_steps": engine.global_steps, "differed_before_load": differed, "mismatches": mismatches,
            "adam_steps": steps}


# --- megatron-core ---------------------------------------------------------------------------


def test_megatron_dist_checkpointing_loads_the_iteration_resume_args_pins(tmp_path):
    _needs("megatron.core", "megatron-core")
    from helpers import cli
    from test_resume_args import _argv

    root, out = str(tmp_path / "megatron"), str(tmp_path / "out")
    os.makedirs(out)
    _ranks("megatron-save", 1, out, root)
    with open(os.path.join(root, TRACKER)) as f:
        assert f.read() == str(MEGATRON_ITERS[-1])
    older, newest = (os.path.join(root, f"iter_{i:07d}") for i in MEGATRON_ITERS[-2:])
    assert {".metadata", "metadata.json", "common.pt"} <= set(os.listdir(older)), os.listdir(older)

    # Real torch_dist files pass the load level (records decoded as DCP's: the RNG
    # ShardedObject's bytes, common.pt's argparse.Namespace).
    r = cli("verify", older, "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr

    # The newest iteration's largest data file cut short, as a crash mid-write leaves it; the
    # tracker still names that iteration.
    data = max((n for n in os.listdir(newest) if n.endswith(".distcp")), key=lambda n: os.path.getsize(os.path.join(newest, n)))
    with open(os.path.join(newest, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest, data)) // 2)

    r = cli("verify", root, "--latest", "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    (pointer,) = r.json()["pointers"]
    assert (pointer["pointer"], pointer["target"], pointer["ok"]) == (TRACKER, os.path.basename(newest), False), pointer
    assert pointer["verifies"]["name"] == os.path.basename(older), pointer
    r = cli("latest", root)  # --load ROOT alone reads the tracker: nothing usable on stdout
    assert r.exit_code == 1 and r.stdout == "", r.stdout + r.stderr

    argv = _argv(root)
    assert argv == ["--load", root, "--ckpt-step", str(MEGATRON_ITERS[-2])]
    (got,) = _ranks("megatron-load", 1, out, *argv)
    assert got["directory"] == older and got["iteration"] == MEGATRON_ITERS[-2], got
    assert got["mismatches"] == [] and got["compared"] >= 4, got


def _megatron_cpu() -> None:
    import torch

    # megatron-core is a GPU stack: its torch_dist saver syncs the device before writing
    # (filesystem_async.py, preload_tensors) and broadcasts its failure flag on the current
    # CUDA device (state_dict_saver.py). On a CPU-only torch both would raise; the tensors are
    # on the CPU already, so the sync is nothing to do and the flag travels on the CPU (gloo).
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _megatron_state(iteration: int, fill: float | None = None) -> dict:
    """A tiny state dict as Megatron-LM's ``generate_state_dict`` builds it: ``args``,
    ``iteration`` and the checkpoint version in common.pt; the model's and the optimizer's
    sharded tensors (Adam moments under ``optimizer.state.*``); the RNG state as a
    ``ShardedObject``. ``fill`` None: values that depend on the iteration; else a template."""
    import random

    import numpy as np
    import torch
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def t(name: str, shape: tuple[int, ...], salt: int) -> ShardedTensor:
        if fill is None:
            value = torch.Generator().manual_seed(iteration * 1000 + salt)
            data = torch.randn(shape, generator=value)
        else:
            data = torch.full(shape, fill)
        return ShardedTensor.from_rank_offsets(name, data, replica_id=0)

    params = {"embedding.word_embeddings.weight": (16, 8), "output_layer.weight": (16, 8)}
    model = {k: t(k, shape, i) for i, (k, shape) in enumerate(params.items())}
    optim = {f"{moment}.{k}": t(f"optimizer.state.{moment}.{k}", shape, 10 + 2 * i + j)
             for i, (k, shape) in enumerate(params.items()) for j, moment in enumerate(("exp_avg", "exp_avg_sq"))}
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    return {"args": argparse.Namespace(iteration=iteration, micro_batch_size=2), "checkpoint_version": 3.0,
            "iteration": iteration, "model": model, "optimizer": {"state": optim},
            "rng_state": ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=0)}


def _megatron_save(rank: int, out: str, root: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _megatron_cpu()
    dist.init_process_group("gloo")
    for it in MEGATRON_ITERS:
        # megatron/training/checkpointing.py, save_checkpoint: the iteration directory
        # (get_checkpoint_name, 'iter_{:07d}'), dist_checkpointing.save into it, a barrier,
        # then rank 0 writes the iteration into the tracker (get_checkpoint_tracker_filename).
        where = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(where, exist_ok=True)
        dist_checkpointing.save(_megatron_state(it), where)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(root, TRACKER), "w") as f:
                f.write(str(it))
    return {}


def _megatron_load(rank: int, out: str, *argv: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    _megatron_cpu()
    dist.init_process_group("gloo")
    parser = argparse.ArgumentParser()  # as megatron/training/arguments.py declares them
    parser.add_argument("--load", type=str)
    parser.add_argument("--ckpt-step", type=int)
    args = parser.parse_args(argv)
    iteration = args.ckpt_step
    if iteration is None:  # no pin: the tracker decides (read_metadata in checkpointing.py)
        with open(os.path.join(args.load, TRACKER)) as f:
            iteration = int(f.read().strip())
    where = os.path.join(args.load, f"iter_{iteration:07d}")  # get_checkpoint_name
    got = dist_checkpointing.load(_megatron_state(0, fill=0.0), where)
    want = _megatron_state(iteration)

    def tensors(sd: dict, prefix: str = "") -> dict:
        found = {}
        for k, v in sd.items():
            if isinstance(v, dict):
                found.update(tensors(v, f"{prefix}{k}."))
            elif isinstance(v, ShardedTensor):
                found[prefix + k] = v.data
            elif torch.is_tensor(v):
                found[prefix + k] = v
        return found

    w, g = tensors(want), tensors(got)
    mismatches = sorted(set(w) ^ set(g)) + [k for k in sorted(set(w) & set(g)) if not torch.equal(w[k], g[k])]
    return {"directory": where, "iteration": got["iteration"], "mismatches": mismatches, "compared": len(w)}


ROLES = {"ds-save": _ds_save, "ds-load": _ds_load, "megatron-save": _megatron_save, "megatron-load": _megatron_load}


if __name__ == "__main__":  # a rank: python THIS_FILE ROLE OUT [ARGS...]
    role, out_dir, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = int(os.environ["RANK"])
    result = ROLES[role](rank, out_dir, *rest)  # a failure: traceback in the log, exit 1
    with open(os.path.join(out_dir, f"{role}.rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out_dir, f"{role}.rank{rank}.json.tmp"), os.path.join(out_dir, f"{role}.rank{rank}.json"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # the rendezvous store lives in rank 0 (env://): no rank leaves before the others
        dist.destroy_process_group()
    # A normal exit, not os._exit: megatron-core's writer starts a multiprocessing manager,
    # which only the interpreter's exit handlers stop (os._exit would orphan it).
