"""``ckptctl seal``: checksums for other tools' checkpoints, checked by ``verify``,
trusted by ``prune``, carried by ``cp``/``restore``. Checkpoints are built as the stacks write
them (tests/test_layouts.py names each stack's source); faults are real bytes in real files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.seal import SEAL, Seal, SealedFile, encode_seal, parse_seal
from ckptctl.layouts.classify import checkpoint_below
from ckptctl.ops.verify.engine import verify as verify_stack
from ckptctl.ops.seal.sealing import seal_checkpoint
from ckptctl.storage import open_storage
from helpers import cli, dead_pid, make_checkpoints
from test_layouts import HOURS, _age, dcp_step, deepspeed_tag, flip, hf_checkpoint


def _files(path: str) -> dict[str, tuple[int, float, bytes]]:
    out = {}
    for dirpath, _d, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            if n != SEAL:
                st = os.stat(full)
                out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime, open(full, "rb").read())
    return out


def test_seal_then_a_flipped_byte_is_named_with_its_range(tmp_path):
    root = str(tmp_path)
    ckpt = hf_checkpoint(root, 100)
    before = _files(ckpt)
    r = cli("seal", ckpt, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["schema"] == 2 and doc["ok"] is True
    (res,) = doc["checkpoints"]
    assert res["status"] == "sealed" and res["layout"] == "hf-trainer" and res["step"] == 100
    assert [n for n in res["not_loaded"] if "training_args.bin" in n][0].endswith("never unpickled")
    assert parse_seal(open(os.path.join(ckpt, SEAL), "rb").read(), "s").not_loaded == tuple(res["not_loaded"])
    assert _files(ckpt) == before  # sealing never touches the checkpoint's own files
    seal = parse_seal(open(os.path.join(ckpt, SEAL), "rb").read(), "seal")
    assert {f.name for f in seal.files} == set(before) and seal.tool["ckptctl"]
    raw = open(os.path.join(ckpt, SEAL), "rb").read()
    r = cli("seal", ckpt, "--json")  # write-if-absent: the seal is never replaced
    assert r.exit_code == 0 and r.json()["checkpoints"][0]["status"] == "already sealed"
    assert open(os.path.join(ckpt, SEAL), "rb").read() == raw
    r = cli("verify", ckpt, "--json")
    assert r.exit_code == 0, r.stdout
    assert "every byte checked against it" in r.json()["checkpoints"][0]["note"]
    # bit rot that still decodes: the stack's own check cannot see it, the seal can
    model = os.path.join(ckpt, "model.safetensors")
    flip(model, os.path.getsize(model) - 3)
    r = cli("verify", ckpt, "--json")
    assert r.exit_code == 1
    (problem,) = r.json()["checkpoints"][0]["problems"]
    assert problem["file"] == "model.safetensors" and problem["byte_range"] == [0, os.path.getsize(model)]


def test_files_added_removed_resized_after_sealing_are_reported(tmp_path):
    root = str(tmp_path)
    ckpt = hf_checkpoint(root, 7)
    assert cli("seal", root).exit_code == 0
    with open(os.path.join(ckpt, "extra.pt"), "wb") as f:
        f.write(b"x")
    os.unlink(os.path.join(ckpt, "scheduler.pt"))
    with open(os.path.join(ckpt, "config.json"), "a") as f:
        f.write(" ")
    r = cli("verify", ckpt, "--quick", "--json")
    assert r.exit_code == 1
    text = " ".join(p["text"] for p in r.json()["checkpoints"][0]["problems"])
    assert "scheduler.pt: removed after sealing" in text
    assert "config.json" in text and "resized after sealing" in text
    # A file the Trainer never reads on resume: reported, never a reason to call it broken.
    assert "extra.pt" not in text and "extra.pt: added after sealing" in r.json()["checkpoints"][0]["note"]


def test_large_files_are_sealed_per_chunk_so_bit_rot_is_located(tmp_path):
    from safetensors.torch import save_file

    root = str(tmp_path)
    ckpt = hf_checkpoint(root, 3)
    save_file({"w": torch.zeros(3 << 18)}, os.path.join(ckpt, "model.safetensors"))  # 3 MiB and a header
    found = checkpoint_below(ckpt)
    assert found is not None
    layout, st = found.in_layout, found.storage
    res = seal_checkpoint(st, layout, chunk_size=1 << 20)
    assert res.status == "sealed"
    seal = parse_seal(open(os.path.join(ckpt, SEAL), "rb").read(), "seal")
    (model,) = [f for f in seal.files if f.name == "model.safetensors"]
    assert len(model.chunks) == 4
    flip(os.path.join(ckpt, "model.safetensors"), (2 << 20) + 5)  # inside the third MiB
    report = verify_stack(st, layout, "checksums")
    assert [(p.file, p.byte_range) for p in report.problems] == [("model.safetensors", (2 << 20, 3 << 20))]


def test_incomplete_refused_native_no_op_root_seals_the_rest(tmp_path):
    root = str(tmp_path)
    hf_checkpoint(root, 1)
    hf_checkpoint(root, 2, state=False)  # killed before trainer_state.json
    r = cli("seal", os.path.join(root, "checkpoint-2"))
    assert r.exit_code == 1 and "not a complete hf-trainer checkpoint" in r.stderr
    assert not os.path.exists(os.path.join(root, "checkpoint-2", SEAL))
    r = cli("seal", root, "--json")
    assert r.exit_code == 0, r.stdout
    got = {c["name"]: c["status"] for c in r.json()["checkpoints"]}
    assert got == {"checkpoint-1": "sealed", "checkpoint-2": "skipped"}
    assert os.path.exists(os.path.join(root, "checkpoint-1", SEAL))
    # a checkpoint that does not test-load is never sealed
    opt = os.path.join(root, "checkpoint-3")
    hf_checkpoint(root, 3)
    with open(os.path.join(opt, "optimizer.pt"), "r+b") as f:
        f.truncate(100)
    r = cli("seal", root, "--json")
    assert r.exit_code == 1
    got = {c["name"]: c["status"] for c in r.json()["checkpoints"]}
    assert got["checkpoint-1"] == "already sealed" and got["checkpoint-3"] == "failed"
    assert not os.path.exists(os.path.join(opt, SEAL))
    # ckptctl's own checkpoints carry checksums: nothing to do, and nothing written
    own = str(tmp_path / "own")
    make_checkpoints(own, [5])
    r = cli("seal", os.path.join(own, "step-0000000005"), "--json")
    assert r.exit_code == 0 and r.json()["checkpoints"][0]["status"] == "not needed"
    assert not os.path.exists(os.path.join(own, "step-0000000005", SEAL))


def test_dcp_and_deepspeed_seal_and_verify(tmp_path):
    root = str(tmp_path)
    path = dcp_step(root, 10)
    assert cli("seal", path).exit_code == 0
    assert cli("verify", path).exit_code == 0
    ds = str(tmp_path / "ds")
    os.makedirs(ds)
    tag = deepspeed_tag(ds, 20)
    assert cli("seal", tag).exit_code == 0
    flip(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), 40)
    r = cli("verify", tag, "--json")
    assert r.exit_code == 1 and "zero_pp_rank_1" in r.stdout


def test_prune_trusts_a_sealed_anchor_and_seal_seals_what_it_verified(tmp_path):
    root = str(tmp_path)
    for s in (100, 200, 300):
        hf_checkpoint(root, s)
    r = cli("prune", root, "--keep-last", "2", "--seal", "--dry-run", "--json")
    assert r.exit_code == 0 and not os.path.exists(os.path.join(root, "checkpoint-300", SEAL))  # a dry run writes nothing
    r = cli("prune", root, "--keep-last", "2", "--seal", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert os.path.exists(os.path.join(root, "checkpoint-300", SEAL))
    assert not os.path.exists(os.path.join(root, "checkpoint-100"))  # deleted, seal or not
    # the next run trusts the seal: bytes re-checksummed, not test-loaded again
    r = cli("prune", root, "--keep-last", "2", "--yes", "--json")
    assert r.exit_code == 0, r.stdout
    items = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert "test-loaded when sealed" in items["checkpoint-300"]["verification"]["note"]
    # a flipped byte in the sealed anchor: it is broken, the older one becomes the anchor
    flip(os.path.join(root, "checkpoint-300", "model.safetensors"), 200)
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    items = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert items["checkpoint-300"]["status"] == "broken" and items["checkpoint-200"]["action"] == "keep"
    assert os.path.isdir(os.path.join(root, "checkpoint-300"))


def test_a_pruned_sealed_checkpoint_is_deleted_whole_commit_file_first(tmp_path):
    from ckptctl.layouts.hf_trainer import HfTrainerLayout

    order = HfTrainerLayout().removal_order(["model.safetensors", SEAL, "trainer_state.json", "optimizer.pt"])
    assert order[:2] == ["trainer_state.json", SEAL]
    root = str(tmp_path)
    for s in (1, 2):
        hf_checkpoint(root, s)
    assert cli("seal", root).exit_code == 0
    r = cli("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 0 and not os.path.exists(os.path.join(root, "checkpoint-1"))


def _seal_doc(**over) -> bytes:
    seal = Seal("hf-trainer", "checkpoint-1", 1, 1.7e9, {"ckptctl": "0"},
                (SealedFile("a.pt", 3, "0123456789abcdef"),))
    doc = json.loads(encode_seal(seal))
    for k, v in over.items():
        doc[k] = v
    return json.dumps(doc).encode()


@pytest.mark.parametrize("over, needle", [
    ({"files": [{"name": "../x", "size": 1, "xxh3": "0123456789abcdef"}]}, "plain relative path"),
    ({"files": [{"name": "a", "size": 1, "xxh3": "0123456789abcdef"}] * 2}, "named twice"),
    ({"files": [{"name": "a", "size": 1, "xxh3": "XYZ"}]}, "hex"),
    ({"files": [{"name": "a", "size": 1 << 30, "xxh3": "0123456789abcdef", "chunks": []}]}, "needs 16"),
    ({"version": 9}, "newer ckptctl"),
    ({"kind": "other"}, "not a ckptctl seal"),
    ({"files": [{"name": SEAL, "size": 1, "xxh3": "0123456789abcdef"}]}, "plain relative path"),
])
def test_hostile_seals_are_refused(over, needle):
    assert parse_seal(_seal_doc(), "s").files[0].name == "a.pt"
    with pytest.raises(InvalidCheckpoint, match=needle):
        parse_seal(_seal_doc(**over), "s")
    with pytest.raises(InvalidCheckpoint):
        parse_seal(b"{" * 100000, "s")


def test_a_damaged_seal_fails_verify(tmp_path):
    ckpt = hf_checkpoint(str(tmp_path), 4)
    assert cli("seal", ckpt).exit_code == 0
    with open(os.path.join(ckpt, SEAL), "r+b") as f:
        f.truncate(50)
    r = cli("verify", ckpt)
    assert r.exit_code == 1 and SEAL in r.stdout + r.stderr
    r = cli("seal", ckpt)
    assert r.exit_code == 1  # never replaced silently


@pytest.mark.parametrize("sealed", [False, True])
def test_what_a_killed_seal_leaves_never_fails_an_intact_checkpoint(tmp_path, sealed):
    """A ``seal`` killed mid-write leaves its hidden temporary (``..ckptctl-seal.json.tmp-PID-HEX``)
    beside the checkpoint, sealed before or not: that is ckptctl's leftover, not a file of the
    checkpoint, and verify, latest and a later seal take the checkpoint for what it is."""
    root = str(tmp_path)
    ckpt = hf_checkpoint(root, 4)
    if sealed:
        assert cli("seal", ckpt).exit_code == 0
    with open(os.path.join(ckpt, f".{SEAL}.tmp-{dead_pid()}-0a1b2c3d"), "wb") as f:
        f.write(b'{"half": ')
    r = cli("verify", ckpt)
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt, r.stdout + r.stderr
    if not sealed:
        assert cli("seal", ckpt).exit_code == 0
        r = cli("verify", ckpt)
        assert r.exit_code == 0 and "checksums" in r.stdout, r.stdout + r.stderr


def test_old_partial_with_seal_left_is_still_claimed(tmp_path):
    root = str(tmp_path)
    ckpt = hf_checkpoint(root, 9)
    assert cli("seal", ckpt).exit_code == 0
    os.unlink(os.path.join(ckpt, "trainer_state.json"))  # a delete cut short after the commit file
    _age(ckpt, 7 * HOURS)
    hf_checkpoint(root, 10)
    r = cli("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 0 and not os.path.exists(ckpt)


# --- cp and restore of other tools' checkpoints ----------------------------------------------


def test_cp_unsealed_hf_is_test_loaded_at_the_destination_commit_file_last(tmp_path):
    os.makedirs(tmp_path / "src")
    src = hf_checkpoint(str(tmp_path / "src"), 50)
    dst_root = str(tmp_path / "dst")
    r = cli("cp", src, dst_root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["layout"] == "hf-trainer" and "test-loaded at the destination" in doc["note"]
    copy = os.path.join(dst_root, "checkpoint-50")
    assert {k: v[2] for k, v in _files(copy).items()} == {k: v[2] for k, v in _files(src).items()}
    # the commit file was written last: its mtime is the newest of the copy
    mtimes = {k: v[1] for k, v in _files(copy).items()}
    assert mtimes["trainer_state.json"] == max(mtimes.values())
    assert cli("cp", src, dst_root).exit_code == 0  # run again: already present
    # a source that does not load commits nothing
    bad = hf_checkpoint(str(tmp_path / "src"), 60)
    with open(os.path.join(bad, "optimizer.pt"), "r+b") as f:
        f.truncate(200)
    r = cli("cp", bad, dst_root)
    assert r.exit_code == 1 and not os.path.exists(os.path.join(dst_root, "checkpoint-60", "trainer_state.json"))


def test_cp_sealed_checks_each_byte_and_restore_picks_newest_complete(tmp_path):
    src_root = str(tmp_path / "src")
    os.makedirs(src_root)
    for s in (1, 2, 3):
        hf_checkpoint(src_root, s)
    hf_checkpoint(src_root, 4, state=False)  # incomplete: never restored
    assert cli("seal", src_root).exit_code == 0
    flip(os.path.join(src_root, "checkpoint-3", "optimizer.pt"), 70)  # bit rot after sealing
    dst = str(tmp_path / "dst")
    r = cli("restore", src_root, dst, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["step"] == 2 and doc["skipped"][0]["step"] == 3 and "optimizer.pt" in doc["skipped"][0]["reason"]
    assert "against the source's seal" in doc["copy"]["note"]
    assert sorted(os.listdir(dst)) == ["checkpoint-2"]  # nothing of step 3 left behind
    assert os.path.exists(os.path.join(dst, "checkpoint-2", SEAL))
    assert cli("verify", os.path.join(dst, "checkpoint-2")).exit_code == 0
    r = cli("restore", src_root, dst, "--step", "3")
    assert r.exit_code == 1 and "bytes" in r.stderr


def test_restore_deepspeed_writes_latest_last_and_never_backwards(tmp_path):
    src = str(tmp_path / "src")
    os.makedirs(src)
    deepspeed_tag(src, 10)
    deepspeed_tag(src, 20)
    dst = str(tmp_path / "dst")
    r = cli("restore", src, dst, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["step"] == 20 and open(os.path.join(dst, "latest")).read() == "global_step20"
    assert "latest written last" in r.json()["copy"]["note"]
    r = cli("cp", os.path.join(src, "global_step10"), dst, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert open(os.path.join(dst, "latest")).read() == "global_step20"  # not moved back
    assert "newer step (20)" in r.json()["note"]
    rows = {e.name: e.status for e in catalog_list(dst)}
    assert rows == {"global_step10": "committed", "global_step20": "committed"}


def catalog_list(root: str):
    from ckptctl.layouts import catalog

    return catalog.list_checkpoints(open_storage(root))


def test_sealed_checkpoint_round_trips_through_s3(tmp_path, s3_url):
    src_root = str(tmp_path / "src")
    os.makedirs(src_root)
    hf_checkpoint(src_root, 5)
    ckpt = hf_checkpoint(src_root, 6)
    # Unsealed: copied, then test-loaded on S3 itself (each file streamed back to a temporary).
    unsealed = cli("cp", ckpt, s3_url)
    assert unsealed.exit_code == 0 and "test-loaded at the destination" in unsealed.stderr, unsealed.stderr
    assert cli("verify", f"{s3_url}/checkpoint-6", "--load").exit_code == 0
    assert cli("seal", src_root).exit_code == 0
    # Sealed since: the copy already there matches the seal byte for byte, and gets the seal.
    r = cli("cp", ckpt, s3_url, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["dst"] == f"{s3_url}/checkpoint-6" and r.json()["status"] == "already present"
    assert cli("verify", f"{s3_url}/checkpoint-6", "--json").json()["checkpoints"][0]["ok"]
    assert cli("cp", os.path.join(src_root, "checkpoint-5"), s3_url).exit_code == 0
    back = str(tmp_path / "back")
    r = cli("restore", s3_url, back, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["step"] == 6
    assert {k: v[2] for k, v in _files(os.path.join(back, "checkpoint-6")).items()} == \
        {k: v[2] for k, v in _files(ckpt).items()}
    assert cli("verify", os.path.join(back, "checkpoint-6")).exit_code == 0
    r = cli("cp", f"{s3_url}/checkpoint-5", str(tmp_path / "one"), "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert os.path.exists(os.path.join(str(tmp_path / "one"), "checkpoint-5", "trainer_state.json"))
    # bit rot on the object store: the newest is skipped, nothing of it lands, the older one does
    import boto3

    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")
    key = f"{prefix}/checkpoint-6/optimizer.pt"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[80] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    again = str(tmp_path / "again")
    r = cli("restore", s3_url, again, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["step"] == 5 and "optimizer.pt" in r.json()["skipped"][0]["reason"]
    assert sorted(os.listdir(again)) == ["checkpoint-5"]


def test_restore_megatron_and_dcp_roots(tmp_path):
    from test_layouts import megatron_iter

    src = str(tmp_path / "meg")
    os.makedirs(src)
    megatron_iter(src, 1000)
    megatron_iter(src, 2000)
    megatron_iter(src, 3000, tracker=False)  # killed before the tracker: not complete, not restored
    dst = str(tmp_path / "meg-dst")
    r = cli("restore", src, dst, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["step"] == 2000 and r.json()["path"] == dst  # Megatron's --load takes the root
    assert open(os.path.join(dst, "latest_checkpointed_iteration.txt")).read() == "2000"
    assert os.path.isfile(os.path.join(dst, "iter_0002000", "mp_rank_00", "model_optim_rng.pt"))
    assert [e.status for e in catalog_list(dst)] == ["committed"]
    titan = str(tmp_path / "titan")
    os.makedirs(titan)
    dcp_step(titan, 10)
    dcp_step(titan, 20, complete=False)
    assert cli("seal", titan).exit_code == 0
    r = cli("restore", titan, str(tmp_path / "titan-dst"), "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json()["step"] == 10 and cli("verify", r.json()["path"]).exit_code == 0
