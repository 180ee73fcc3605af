"""``ckptctl reshard``: bitwise across world sizes, refusals, and memory bounded by the largest
tensor, through the real CLI on real files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, shard_name
from ckptctl.load.reader import CheckpointReader
from ckptctl.ops.transform.reshard import plan_layout
from ckptctl.format.manifest import Manifest, TensorEntry
from ckptctl.storage import open_storage
from helpers import cli


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.ReLU(), torch.nn.Linear(700, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 600)).sum().backward()
    opt.step()
    return model, opt


def saved(tmp_path) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = make_model()
    with Checkpointer(str(tmp_path / "root")) as ck:
        path = ck.save(5, {"model": model, "optimizer": opt, "extra": {"epoch": 2}}).wait()
    return path, model, opt


def tensors_of(path: str) -> dict[str, torch.Tensor]:
    with CheckpointReader(open_storage(path)) as r:
        return {n: r.read(n) for n in r.manifest.tensors}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].view(torch.uint8) if a[n].dim() else a[n], b[n].view(torch.uint8) if b[n].dim() else b[n]), n


def test_reshard_1_4_3_1_4_bitwise_and_loads(tmp_path):
    src, model, opt = saved(tmp_path)
    original = tensors_of(src)
    prev = src
    for m in (4, 3, 1, 4):  # the 4 -> 3 -> 1 -> 4, from a 1-rank save
        dst = str(tmp_path / f"ws{m}-from-{os.path.basename(prev)}")
        r = cli("reshard", prev, dst, "--world-size", str(m), "--json")
        assert r.exit_code == 0, r.stderr
        doc = r.json()
        assert doc["world_size"] == m and doc["files"] == m
        assert sorted(f for f in os.listdir(dst) if f.endswith(".safetensors")) == [shard_name(i, m) for i in range(m)]
        assert_bitwise(original, tensors_of(dst))
        assert cli("verify", dst).exit_code == 0
        prev = dst
    # The 1-rank result loads into a fresh model and optimizer, bitwise.
    fresh, fresh_opt = make_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    extra: dict = {}
    Checkpointer(str(tmp_path / "unused")).load(str(tmp_path / "ws1-from-ws3-from-ws4-from-step-0000000005"), {"model": fresh, "optimizer": fresh_opt, "extra": extra})
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][key], sb[k][key])
    # The source was never touched.
    assert_bitwise(original, tensors_of(src))


def test_layout_splits_large_tensors_like_torch_chunk_and_balances_small_ones():
    m = Manifest(step=1, created=0.0, world_size=1, files=[], tensors={
        "big": TensorEntry("float32", (10, 1000), "model", 1),  # 40 kB: split when threshold is small
        "s1": TensorEntry("float32", (100,), "model", 1),
        "s2": TensorEntry("float32", (90,), "model", 1),
        "s3": TensorEntry("float32", (80,), "model", 1),
        "step": TensorEntry("int64", (), "optimizer", 1),
    })
    plan = plan_layout(m, 4, split_bytes=1000)
    rows = [[s.shape[0] for s in r if s.name == "big"] for r in plan]
    assert rows == [[3], [3], [3], [1]]  # torch.chunk(t, 4) on 10 rows
    assert [len(x) for x in torch.chunk(torch.empty(10), 4)] == [3, 3, 3, 1]
    small = {s.name: i for i, r in enumerate(plan) for s in r if s.name != "big"}
    assert set(small.values()) == {3}  # rank 3 holds 4 kB of "big", the others 12 kB: it takes them
    # Without the big tensor, small ones go to different ranks, largest first.
    del m.tensors["big"]
    plan = plan_layout(m, 4, split_bytes=1000)
    assert [[s.name for s in r] for r in plan] == [["s1"], ["s2"], ["s3"], ["step"]]


def test_corrupted_source_refused_and_target_not_committed(tmp_path):
    src, _, _ = saved(tmp_path)
    shard = os.path.join(src, shard_name(0, 1))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = str(tmp_path / "out")
    r = cli("reshard", src, dst, "--world-size", "2")
    assert r.exit_code == 1
    assert "checksum" in r.stderr and "source" in r.stderr
    assert not os.path.exists(os.path.join(dst, MARKER))


@pytest.mark.parametrize("tensor, world_size", [
    ("model/0.weight", 2),  # split across target ranks: caught by pass 1, which checks the source chunk
    ("model/0.weight", 1),  # whole tensor in both: its source checksum is reused, caught by pass 2
    ("model/2.bias", 2),  # small, stored whole: caught by pass 2
])
def test_corrupt_source_chunk_refused_wherever_it_is_read(tmp_path, tensor, world_size):
    """The source is no longer verified by a read of its own: each chunk is checked as
    pass 1 or pass 2 reads it, before anything is committed."""
    src, _, _ = saved(tmp_path)
    with CheckpointReader(open_storage(src)) as r:
        (loc,) = r.chunks(tensor)
        at = loc.data_start + (loc.chunk.begin + loc.chunk.end) // 2
    with open(os.path.join(src, loc.file), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    dst = str(tmp_path / "out")
    r = cli("reshard", src, dst, "--world-size", str(world_size))
    assert r.exit_code == 1, r.stderr
    assert "checksum" in r.stderr and "source" in r.stderr
    assert not os.path.exists(os.path.join(dst, MARKER))
    assert not os.path.exists(os.path.join(dst, "manifest.json"))
    assert not os.path.exists(dst) or os.listdir(dst) == []  # the shards written before the refusal are gone


def test_source_header_with_a_changed_chunk_checksum_refused(tmp_path):
    """A header whose recorded chunk checksum was altered (data and checksum could then agree)
    fails the file checksum, which is rebuilt from the headers the reshard uses."""
    src, _, _ = saved(tmp_path)
    with CheckpointReader(open_storage(src)) as r:
        (loc,) = r.chunks("model/0.weight")
        h = r.headers[loc.file]
    old = loc.chunk.checksum.encode()
    at = h.header_bytes.index(old)
    with open(os.path.join(src, loc.file), "r+b") as f:
        f.seek(at)
        f.write(old[:-1] + (b"0" if old[-1:] != b"0" else b"1"))
    dst = str(tmp_path / "out")
    r = cli("reshard", src, dst, "--world-size", "2")
    assert r.exit_code == 1, r.stderr
    assert "checksum" in r.stderr and "source" in r.stderr
    assert not os.path.exists(os.path.join(dst, MARKER))


def test_pass1_checksums_match_a_plain_hash_of_each_target_chunk(tmp_path):
    """``checked_source_checksums`` (one read for row splits, two for column splits and 0-d)
    gives each target chunk the checksum of its bytes."""
    from ckptctl.format.checksum import digest
    from ckptctl.ops.transform.reshard import sharded_dims
    from ckptctl.ops.transform.reshard_source import checked_source_checksums

    src, _, _ = saved(tmp_path)
    whole = tensors_of(src)
    with CheckpointReader(open_storage(src)) as r:
        for m in (1, 3, 4):
            plan = plan_layout(r.manifest, m, split_bytes=1000, dims=sharded_dims(r))  # nothing known: every chunk hashed
            specs = [s for p in plan for s in p]
            got, nread = checked_source_checksums(r, specs, piece_bytes=4096 + 12)  # pieces that cut rows
            assert nread >= sum(s.nbytes for s in specs)
            for s, g in zip(specs, got):
                region = whole[s.name][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))].contiguous()
                assert g.checksum == digest(region.reshape(-1).view(torch.uint8).numpy().tobytes()), (m, s)


def test_existing_target_refused_unless_overwrite(tmp_path):
    src, _, _ = saved(tmp_path)
    dst = str(tmp_path / "out")
    assert cli("reshard", src, dst, "--world-size", "2").exit_code == 0
    r = cli("reshard", src, dst, "--world-size", "3")
    assert r.exit_code == 1 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert cli("reshard", src, dst, "--world-size", "3", "--overwrite").exit_code == 0
    assert sorted(f for f in os.listdir(dst) if f.endswith(".safetensors")) == [shard_name(i, 3) for i in range(3)]
    assert cli("verify", dst).exit_code == 0
    # Onto the source itself: a usage error, and the source is untouched.
    assert cli("reshard", src, src, "--world-size", "2", "--overwrite").exit_code == 2
    assert cli("verify", src).exit_code == 0


# --- memory --------------------------------------------------------------------------------

TENSORS, TENSOR_MIB = 24, 16  # 384 MiB of state, the largest tensor 16 MiB (16 MiB blocks exposed a heap leak)
SLACK_MIB = 160  # verify: 4 threads x 2 x 16 MiB pieces = 128 MiB; reader temporaries, allocator slack


# The measuring parent must be small: on Linux a child's peak RSS starts at its parent's when
# it was forked (the kernel carries the old memory's high-water mark across exec), so pytest
# (torch loaded) would inflate every figure. A bare interpreter runs the command and reports
# the peak of its children. It also turns transparent huge pages off for itself and (inherited
# across fork and exec) the command: with THP "always" the kernel backs heap growth with 2 MiB
# pages and khugepaged collapses partly used ranges, so the same command's peak moved with the
# machine's /sys/kernel/mm/transparent_hugepage/enabled. With THP off, the figure counts the
# bytes the command touched, on any machine. (prctl 41 is PR_SET_THP_DISABLE, Linux >= 3.15;
# where it is missing the call fails harmlessly and the baseline, measured the same way in the
# same run, still absorbs the setting.)
_MEASURE = (
    "import ctypes, resource, subprocess, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "sys.stderr.write(p.stderr)\n"
    "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def peak_rss_mib(args: list[str]) -> float:
    """Peak resident memory (MiB) of ``python ARGS`` run as a grandchild."""
    p = subprocess.run([sys.executable, "-S", "-c", _MEASURE, sys.executable, *args], capture_output=True, text=True, timeout=600)
    code, kib = p.stdout.split()
    assert int(code) == 0, p.stderr
    return int(kib) / 1024


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("big")
    n = TENSOR_MIB * (1 << 20) // 4
    state = {"model": {f"w{i:02d}": torch.full((n // 1024, 1024), float(i)) for i in range(TENSORS)}}
    with Checkpointer(str(root)) as ck:
        path = ck.save(1, state).wait()
    return path


def baseline_mib(more_imports: str = "") -> float:
    # What the CLI costs before touching any checkpoint: interpreter, torch, the app, and the
    # ops modules that `reshard` and `convert` import when they start (the app itself no
    # longer imports them, so that torch-free commands start fast).
    return peak_rss_mib(["-c", "import torch, ckptctl.cli.app, ckptctl.ops.transform.convert, ckptctl.ops.transform.reshard, "
                               "ckptctl.ops.verify.engine, safetensors" + more_imports])


def test_reshard_memory_is_bounded_by_the_largest_tensor(big_checkpoint, tmp_path):
    base = baseline_mib()
    total = TENSORS * TENSOR_MIB
    for m in (1, 3, 4):
        peak = peak_rss_mib(["-m", "ckptctl", "reshard", big_checkpoint, str(tmp_path / f"ws{m}"), "--world-size", str(m)])
        bound = base + TENSOR_MIB + SLACK_MIB
        print(f"reshard -> {m}: peak {peak:.0f} MiB, baseline {base:.0f} MiB, checkpoint {total} MiB, bound {bound:.0f} MiB")
        assert peak < bound, f"peak RSS {peak:.0f} MiB exceeds {bound:.0f} MiB (baseline {base:.0f}) for a {total} MiB checkpoint"


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "ckptctl", *args], capture_output=True, text=True, timeout=300)


def test_reshard_under_torchrun_splits_the_writing_over_ranks(tmp_path):
    src, _, _ = saved(tmp_path)
    dst = str(tmp_path / "ws3")
    p = _torchrun(2, "reshard", src, dst, "--world-size", "3", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    doc = json.loads(p.stdout[p.stdout.index("{"):])  # rank 0 alone prints
    assert doc["writers"] == 2 and doc["files"] == 3
    assert_bitwise(tensors_of(src), tensors_of(dst))
    # A corrupt source fails every rank (none is left waiting) and nothing is committed.
    shard = os.path.join(src, shard_name(0, 1))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 10)
        f.write(b"\xff" * 4)
    bad = str(tmp_path / "bad")
    p = _torchrun(2, "reshard", src, bad, "--world-size", "3")
    assert p.returncode != 0 and "checksum" in p.stderr
    assert not os.path.exists(os.path.join(bad, MARKER))
    assert not os.path.exists(bad) or os.listdir(bad) == []


@pytest.mark.slow
def test_reshard_a_real_4_rank_fsdp2_save_then_3_ranks_load_it(tmp_path):
    """The distributed save's layouts (uneven and empty FSDP2 shards, per-rank state) survive an
    offline reshard: 4 ranks save, ``ckptctl reshard`` writes 3 shards, 3 FSDP2 ranks load."""
    from dist_workers import launch

    root, ref = str(tmp_path / "root"), str(tmp_path / "ref.pt")
    saved_ = launch("train_save", 4, {"mode": "fsdp", "root": root, "save_step": 3, "ref": ref}, str(tmp_path / "a"))
    assert all("error" not in r and "exit" not in r for r in saved_.values()), saved_
    from ckptctl.format.layout import step_dir

    src = os.path.join(root, step_dir(3))
    resharded_root = str(tmp_path / "root3")
    r = cli("reshard", src, os.path.join(resharded_root, step_dir(3)), "--world-size", "3")
    assert r.exit_code == 0, r.stderr
    assert_bitwise(tensors_of(src), tensors_of(os.path.join(resharded_root, step_dir(3))))
    three = launch("load_check", 3, {"mode": "fsdp", "root": resharded_root, "ref": ref}, str(tmp_path / "b"))
    for rank, res in three.items():
        assert "error" not in res and "exit" not in res, (rank, res)
        assert res["step"] == 3 and res["bad"] == [], (rank, res["bad"])
        assert res["extra"]["rank"] == rank  # source rank r's per-rank state went to target rank r


def test_reshard_and_convert_with_object_storage(tmp_path, s3_url):
    src, _, _ = saved(tmp_path)
    remote = f"{s3_url}/ws2/step-0000000005"
    r = cli("reshard", src, remote, "--world-size", "2")
    assert r.exit_code == 0, r.stderr
    assert cli("verify", remote).exit_code == 0
    st = str(tmp_path / "st")
    r = cli("convert", remote, st, "--to", "safetensors")  # a ckptctl checkpoint read from S3
    assert r.exit_code == 0, r.stderr
    back = f"{s3_url}/back"
    r = cli("convert", st, back, "--to", "ckptctl")  # written to S3, committed and verified there
    assert r.exit_code == 0, r.stderr
    assert_bitwise(tensors_of(src), tensors_of(back))
    assert cli("convert", src, f"{s3_url}/x.pt", "--to", "torch").exit_code == 2


def test_column_sharded_tensors_stay_column_sharded(tmp_path):
    """A tensor the source shards along dim 1 (tensor parallel) is split along dim 1."""
    import time as _time

    from ckptctl.format.manifest import Manifest, TensorEntry
    from ckptctl.layouts.native_commit import commit
    from ckptctl.layouts.native_read import read_header
    from ckptctl.ops.transform.stream_shard import ChunkSpec, write_shard_streaming

    w = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    b = torch.arange(6, dtype=torch.float32)
    src_path = str(tmp_path / "tp2")
    src = open_storage(src_path)
    files = []
    for r in range(2):
        specs = [ChunkSpec("model/w", "float32", (6, 5), (0, 5 * r))] + ([ChunkSpec("model/b", "float32", (6,), (0,))] if r == 0 else [])
        fill = lambda s, out, row: out.copy_((w[:, s.offsets[1] : s.offsets[1] + 5] if s.name == "model/w" else b)[row : row + len(out)])  # noqa: E731
        files.append(write_shard_streaming(src, shard_name(r, 2), specs, fill, rank=r).file)
    commit(src, Manifest(step=1, created=_time.time(), world_size=2, files=files,
                         tensors={"model/w": TensorEntry("float32", (6, 10), "model", 2), "model/b": TensorEntry("float32", (6,), "model", 1)},
                         state={"model": {"w": {"__tensor__": "model/w"}, "b": {"__tensor__": "model/b"}}}))
    assert cli("verify", src_path).exit_code == 0
    dst = str(tmp_path / "tp3")
    assert cli("reshard", src_path, dst, "--world-size", "3").exit_code == 0
    st = open_storage(dst)
    chunks = sorted((c.offsets, c.shape) for i in range(3) for c in read_header(st, shard_name(i, 3)).chunks if c.name == "model/w")
    assert chunks == [((0, 0), (6, 4)), ((0, 4), (6, 4)), ((0, 8), (6, 2))]  # torch.chunk(w, 3, dim=1)
    got = tensors_of(dst)
    assert torch.equal(got["model/w"], w) and torch.equal(got["model/b"], b)
    one = str(tmp_path / "one")
    assert cli("reshard", dst, one, "--world-size", "1").exit_code == 0
    assert torch.equal(tensors_of(one)["model/w"], w)
