"""An honest ``load`` level (issue 20 §3): what the level could not decode is not verified at it.

torchtitan checkpoints are written by the real ``torch.distributed.checkpoint.save`` with a
``train_state`` that is a Stateful whose ``state_dict`` holds ``io.BytesIO`` values, as
torchtitan's ``TrainState`` does (torchtitan/components/checkpoint.py); DCP stores each as a
``torch.save`` of the BytesIO (``DefaultSavePlanner.transform_object``), a pickle of a class
outside torch's weights-only list. Megatron's torch_dist iterations are DCP-format
(megatron/core/dist_checkpointing/strategies/torch.py) with ``metadata.json``, ``common.pt``
and TransformerEngine's ``_extra_state`` held as a BytesIO, then the tracker. Faults are real
bytes zeroed in real files.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import warnings

import pytest
import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.seal import SEAL, Seal, encode_seal
from ckptctl.interop.dcp_io import read_metadata
from ckptctl.layouts.registry import layout_named as bound_layout
from ckptctl.ops.verify.engine import verify as verify_stack
from ckptctl.ops.verify.latest import latest_checkpoint
from ckptctl.ops.seal.sealing import seal_checkpoint
from ckptctl.storage import open_storage
from helpers import cli

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp


class TrainState:
    """torchtitan's TrainState: a Stateful whose losses go through torch.save into BytesIO."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.losses = [1.5, 1.25]

    def state_dict(self) -> dict[str, object]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "global_avg_losses": buf}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.step = int(sd["step"])  # type: ignore[call-overload]


class _Unlisted:
    """A class no allow-list names: its pickle is never run."""

    def __init__(self) -> None:
        self.x = 1


def titan_step(root: str, step: int, extra: dict[str, object] | None = None) -> str:
    path = os.path.join(root, f"step-{step}")
    state: dict[str, object] = {"model": {"w": torch.full((64,), float(step))}, "train_state": TrainState(step)}
    state.update(extra or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def zero_record(path: str, fqn_part: str) -> None:
    """Overwrite one record's bytes with zeros in place (same size): a lost write."""
    md = read_metadata(path)
    exact = [i for k, i in md.storage_data.items() if k.fqn == fqn_part]
    (info,) = exact or [i for k, i in md.storage_data.items() if k.fqn.endswith("." + fqn_part)]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))


def megatron_torch_dist(root: str, it: int) -> str:
    """An iteration as Megatron's dist_checkpointing writes it with the torch_dist backend."""
    path = os.path.join(root, f"iter_{it:07d}")
    extra = io.BytesIO()
    torch.save({"fp8_meta": None, "recipe": "delayed"}, extra)  # TransformerEngine's _extra_state
    state = {"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(64, 64),
             "decoder.layers.0.mlp.linear_fc1._extra_state": extra,
             "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(64, 64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    torch.save({"args": argparse.Namespace(hidden_size=64), "iteration": it, "checkpoint_version": 3.0},
               os.path.join(path, "common.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(it))
    return path


def _verify(root: str, name: str, layout: str, level: str = "load"):
    st = open_storage(root)
    return verify_stack(st.sub(name), bound_layout(layout, st), level)  # type: ignore[arg-type]


# --- the structural decode ------------------------------------------------------------------


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_structural_decode_tells_a_whole_stream_from_garbage():
    """A class name alone fails nothing (nothing is ever built): it is named; a broken stream is
    not decoded."""
    from ckptctl.layouts.pickle_scan import scan_pickle, scan_torch_bytes

    inner = io.BytesIO(_saved([1.0]))
    assert scan_torch_bytes(_saved(inner)).problem is None
    assert scan_torch_bytes(_saved({"w": torch.ones(3)})).problem is None
    raw = _saved(inner)
    assert "zeroed" in (scan_torch_bytes(bytes(len(raw))).problem or "")
    assert scan_torch_bytes(raw[: len(raw) // 2]).problem is not None  # truncated
    unlisted = scan_torch_bytes(_saved(_Unlisted()))
    assert unlisted.problem is None and any("_Unlisted" in c for c in unlisted.classes)
    # a bare pickle stream with bytes after STOP, or cut before it
    assert "after the pickle's STOP" in (scan_pickle(b"\x80\x02K\x01.junk")[0].problem or "")
    assert "STOP" in (scan_pickle(b"\x80\x02K\x01")[0].problem or "")
    assert "after the pickle's STOP" in (scan_torch_bytes(b"\x80\x02K\x01.junk").problem or "")
    # a class named by copyreg extension code instead of by name: which class is unknown
    assert "extension code" in (scan_pickle(b"\x80\x02\x82\x01)\x81.")[0].problem or "")
    # protocols 0-5 (protocol 4 on: STACK_GLOBAL takes its names from the stream)
    import pickle

    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        scan = scan_pickle(pickle.dumps(_Unlisted(), protocol=protocol))[0]
        assert scan.problem is None and any("_Unlisted" in c for c in scan.classes), (protocol, scan)
    assert scan_pickle(pickle.dumps({"a": [1, 2.0, "x"]}, protocol=4))[0].problem is None


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_legacy_torch_save_decodes_structurally_and_a_cut_one_does_not(protocol):
    from ckptctl.layouts.pickle_scan import scan_torch_bytes

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3, dtype=torch.float16), "n": torch.arange(4), "cfg": _Unlisted()}, buf,
               _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    raw = buf.getvalue()
    whole = scan_torch_bytes(raw)
    assert whole.problem is None and any("_Unlisted" in c for c in whole.classes), whole
    assert "truncated" in (scan_torch_bytes(raw[:-2]).problem or "")
    assert "after the last storage" in (scan_torch_bytes(raw + b"\0").problem or "")


# --- torchtitan / DCP -------------------------------------------------------------------------


def test_titan_train_state_is_decoded_structurally_and_a_zeroed_one_is_unverified(tmp_path):
    root = str(tmp_path)
    titan_step(root, 10)
    titan_step(root, 20)
    good = _verify(root, "step-20", "dcp")
    assert good.ok, good.problems
    assert "decoded structurally" in (good.note or "") and "train_state.global_avg_losses" in (good.note or "")
    zero_record(os.path.join(root, "step-20"), "global_avg_losses")
    bad = _verify(root, "step-20", "dcp")
    assert not bad.ok
    (problem,) = bad.problems
    assert str(problem).startswith("unverified at load (1 records not decoded:") and "global_avg_losses" in str(problem)
    assert _verify(root, "step-20", "dcp", "checksums").ok  # the lower levels never claimed to decode it
    r = cli("verify", os.path.join(root, "step-20"), "--load", "--json")
    assert r.exit_code == 1 and "unverified at load" in r.stdout
    assert latest_checkpoint(open_storage(root), "load").step == 10
    r = cli("latest", root, "--level", "load")
    assert r.exit_code == 0 and r.stdout.strip() == os.path.join(root, "step-10")
    r = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
    assert r.json()["plan"]["anchors"]["dcp"]["name"] == "step-10", r.stdout


def test_a_record_of_an_unlisted_class_is_decoded_structurally_and_named(tmp_path):
    """A class name alone fails nothing: the record is decoded structurally (never run) and the
    report names the class."""
    root = str(tmp_path)
    titan_step(root, 5, {"extra": {"cfg": _Unlisted()}})
    report = _verify(root, "step-5", "dcp")
    assert report.ok and "_Unlisted" in (report.note or "") and "never unpickled" in (report.note or ""), report
    assert latest_checkpoint(open_storage(root), "load").step == 5


def test_seal_refuses_what_it_cannot_decode_and_names_what_it_decoded_structurally(tmp_path):
    root = str(tmp_path)
    st = open_storage(root)
    titan_step(root, 1)
    res = seal_checkpoint(st.sub("step-1"), bound_layout("dcp", st))
    assert res.status == "sealed" and res.not_loaded and all("decoded structurally" in n for n in res.not_loaded)
    titan_step(root, 2)
    zero_record(os.path.join(root, "step-2"), "global_avg_losses")
    with pytest.raises(InvalidCheckpoint, match="unverified at load"):
        seal_checkpoint(st.sub("step-2"), bound_layout("dcp", st))
    assert not os.path.exists(os.path.join(root, "step-2", SEAL))


def test_an_older_seal_that_vouched_for_undecoded_bytes_does_not_stand_for_load(tmp_path):
    """Before this fix a zeroed record was sealed as "test-loaded": such a seal's checksums match
    the zeros, so prune must decode the checkpoint again instead of trusting the seal."""
    root = str(tmp_path)
    st = open_storage(root)
    path = titan_step(root, 3)
    zero_record(path, "global_avg_losses")
    from ckptctl.format.seal import SealedFile
    from ckptctl.layouts.seal_check import hash_object

    files = []
    for name in sorted(os.listdir(path)):
        got = hash_object(st.sub("step-3"), name, 64 << 20)
        assert got is not None
        files.append(SealedFile(name, got.size, got.xxh3, got.chunks))
    old = Seal(layout="dcp", name="step-3", step=3, created=1.0e9, tool={"ckptctl": "0.1.0"}, files=tuple(files),
               not_loaded=("__0_0.distcp (record train_state.global_avg_losses): not test-loaded "
                           "(pickle of a class outside the allow-list)",))
    with open(os.path.join(path, SEAL), "wb") as f:
        f.write(encode_seal(old))
    trusted = verify_stack(st.sub("step-3"), bound_layout("dcp", st), "load")  # a seal stands for load when honest
    assert not trusted.ok and "unverified at load" in str(trusted.problems[0])


# --- Megatron torch_dist ----------------------------------------------------------------------


def test_megatron_load_decodes_its_dcp_records(tmp_path):
    root = str(tmp_path)
    megatron_torch_dist(root, 100)
    path = megatron_torch_dist(root, 200)
    good = _verify(root, "iter_0000200", "megatron")
    assert good.ok, good.problems
    records = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))
    assert good.bytes_read >= records * 0.9  # every record read, not only .metadata
    assert "_extra_state" in (good.note or "") and "decoded structurally" in (good.note or "")
    zero_record(path, "_extra_state")
    bad = _verify(root, "iter_0000200", "megatron")
    assert not bad.ok and "unverified at load" in str(bad.problems[0]) and "_extra_state" in str(bad.problems[0])
    st = open_storage(root)
    with pytest.raises(InvalidCheckpoint, match="unverified at load"):
        seal_checkpoint(st.sub("iter_0000200"), bound_layout("megatron", st))
    zero_record(path, "decoder.layers.0.mlp.linear_fc1.weight")  # a tensor record: refused by torch itself
    worse = _verify(root, "iter_0000200", "megatron")
    assert any("does not load" in str(p) or "not decoded" in str(p) for p in worse.problems)
    assert latest_checkpoint(st, "load", formats=["megatron"]).step == 100


def test_hf_training_args_is_decoded_structurally_not_assumed(tmp_path):
    """training_args.bin was "presence and size only": now its opcode stream is walked, so a
    zeroed one is reported as not decoded; the Trainer never reads it on resume, so that is
    never a reason to call the checkpoint broken (one verdict: prune still anchors on it)."""
    from safetensors.torch import save_file

    root = str(tmp_path)
    path = os.path.join(root, "checkpoint-5")
    os.makedirs(path)
    save_file({"w": torch.ones(4)}, os.path.join(path, "model.safetensors"))
    torch.save(argparse.Namespace(lr=1.0), os.path.join(path, "training_args.bin"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(path, "optimizer.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 5, "log_history": []}, f)
    good = _verify(root, "checkpoint-5", "hf-trainer")
    assert good.ok and "training_args.bin: decoded structurally" in (good.note or ""), good.note
    size = os.path.getsize(os.path.join(path, "training_args.bin"))
    with open(os.path.join(path, "training_args.bin"), "r+b") as f:
        f.write(bytes(size))
    bad = _verify(root, "checkpoint-5", "hf-trainer")
    assert bad.ok and "training_args.bin: not decoded" in (bad.note or ""), bad.note
    r = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
    assert r.json()["plan"]["anchors"]["hf-trainer"]["name"] == "checkpoint-5", r.stdout
