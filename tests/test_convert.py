"""``ckptctl convert``: bitwise round trips through every format, foreign files written by the
formats' own libraries, refusals, and memory bounded by the largest tensor."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER
from helpers import cli
from test_reshard import TENSOR_MIB, TENSORS, assert_bitwise, baseline_mib, big_checkpoint, make_model, peak_rss_mib, saved, tensors_of  # noqa: F401

SLACK_MIB = 160  # as in test_reshard: verify alone holds up to 128 MiB of pieces


def convert(*args: str):
    return cli("convert", *args)


def test_ckptctl_to_sharded_safetensors_and_back_bitwise_and_loads(tmp_path):
    src, model, opt = saved(tmp_path)
    st = str(tmp_path / "hf")
    r = convert(src, st, "--to", "safetensors", "--max-shard-size", "400KB", "--json")
    assert r.exit_code == 0, r.stderr
    files = sorted(os.listdir(st))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) >= 3
    index = json.load(open(os.path.join(st, "model.safetensors.index.json")))
    assert "model/0.weight" in index["weight_map"]
    for f in files:  # every shard within the limit, unless one tensor alone is larger
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(os.path.join(st, f), framework="pt") as sf:  # safetensors itself reads them
                assert sf.metadata()["format"] == "pt"
    back = str(tmp_path / "back")
    r = convert(st, back, "--to", "ckptctl")
    assert r.exit_code == 0, r.stderr
    assert "found safetensors" in r.stderr and "no checksums" in r.stderr
    assert_bitwise(tensors_of(src), tensors_of(back))
    assert cli("verify", back).exit_code == 0
    # The state tree traveled in the metadata: the result loads into a fresh model + optimizer.
    fresh, fresh_opt = make_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    extra: dict = {}
    Checkpointer(str(tmp_path / "unused")).load(back, {"model": fresh, "optimizer": fresh_opt, "extra": extra})
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == opt.state_dict()["param_groups"][0]["lr"]


def test_torch_to_ckptctl_to_torch_bitwise(tmp_path):
    model, opt = make_model()
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "note": "x",
           "bf": torch.randn(5, 3).to(torch.bfloat16), "ints": torch.arange(7, dtype=torch.int32)}
    pt = str(tmp_path / "in.pt")
    torch.save(obj, pt)
    ck = str(tmp_path / "ck")
    r = convert(pt, ck, "--to", "ckptctl", "--step", "0")  # a bare torch.save file records no step
    assert r.exit_code == 0, r.stderr
    assert "found torch" in r.stderr
    assert cli("verify", ck).exit_code == 0
    out = str(tmp_path / "out.pt")
    assert convert(ck, out, "--to", "torch").exit_code == 0
    import zipfile

    assert zipfile.ZipFile(out).testzip() is None  # a valid zip: CRCs patched in
    got = torch.load(out, weights_only=True)
    assert got.keys() == obj.keys()
    assert got["epoch"] == 3 and got["note"] == "x"
    assert got["optimizer"]["param_groups"] == obj["optimizer"]["param_groups"]
    for k, v in obj["model"].items():
        assert torch.equal(got["model"][k], v)
    for pid, st in obj["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v) and got["optimizer"]["state"][pid][k].dtype == v.dtype
    assert torch.equal(got["bf"].view(torch.int16), obj["bf"].view(torch.int16)) and torch.equal(got["ints"], obj["ints"])


def test_ckptctl_to_dcp_to_ckptctl_bitwise_and_dcp_loads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    src, model, _ = saved(tmp_path)
    d = str(tmp_path / "dcp")
    r = convert(src, d, "--to", "dcp")
    assert r.exit_code == 0, r.stderr
    assert os.path.exists(os.path.join(d, ".metadata"))
    # A training job loads it the standard DCP way: nested state dicts, optimizer by name.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh, fresh_opt = make_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    msd, osd = get_state_dict(fresh, fresh_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=d, no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], tensors_of(src)["optimizer/state/0.weight/exp_avg"])
    back = str(tmp_path / "back")
    r = convert(d, back, "--to", "ckptctl")
    assert r.exit_code == 0, r.stderr
    assert "found dcp" in r.stderr
    assert_bitwise(tensors_of(src), tensors_of(back))
    m = cli("inspect", back, "--json").json()
    assert m["step"] == 5 and "extra" in m["state_keys"]


def test_foreign_dcp_with_nested_state_converts_with_names_and_hyperparameters(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make_model()
    msd, osd = get_state_dict(model, opt)
    d = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=d, no_dist=True)
    out = str(tmp_path / "ck")
    r = convert(d, out, "--to", "ckptctl", "--step", "0", "--json")  # plain dcp.save: no step recorded
    assert r.exit_code == 0, r.stderr
    assert r.json()["dropped"] == []
    t = tensors_of(out)
    assert torch.equal(t["model/0.weight"], model[0].weight)
    assert torch.equal(t["optimizer/state/0.weight/exp_avg"], opt.state[model[0].weight]["exp_avg"])
    fresh, fresh_opt = make_model()
    Checkpointer(str(tmp_path / "unused")).load(out, {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(fresh[2].weight, model[2].weight)
    assert fresh_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_safetensors_written_by_safetensors_converts(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    a = {"embed.weight": torch.randn(10, 4), "layers.0.w": torch.randn(4, 4).half()}
    b = {"layers.1.w": torch.randn(4, 4).to(torch.bfloat16), "head.bias": torch.arange(3, dtype=torch.int64)}
    save_file(a, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(d / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = str(tmp_path / "ck")
    r = convert(str(d), out, "--to", "ckptctl", "--step", "0")  # written by safetensors itself: no step
    assert r.exit_code == 0, r.stderr
    got = tensors_of(out)
    for k, v in (a | b).items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
    # A single file works too, and back out to one .safetensors file.
    one = str(tmp_path / "one.safetensors")
    assert convert(out, one, "--to", "safetensors").exit_code == 0
    from safetensors.torch import load_file

    back = load_file(one)
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in (a | b).items())


def _make_marker(path: str) -> None:
    with open(path, "w") as f:
        f.write("code from a checkpoint ran")


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_make_marker, (self.path,))


def test_pt_with_pickled_custom_class_is_refused_and_nothing_runs(tmp_path):
    marker = str(tmp_path / "PWNED")
    pt = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(3), "payload": Evil(marker)}, pt)
    assert not os.path.exists(marker)
    out = str(tmp_path / "out")
    r = convert(pt, out, "--to", "ckptctl")
    assert r.exit_code == 1
    assert "evil.pt" in r.stderr and "refusing" in r.stderr
    assert not os.path.exists(marker)
    assert not os.path.exists(os.path.join(out, MARKER))


def test_only_and_dtype_keep_weights_for_inference(tmp_path):
    src, model, _ = saved(tmp_path)
    out = str(tmp_path / "w.safetensors")
    r = convert(src, out, "--to", "safetensors", "--only", "model/", "--dtype", "bf16", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["skipped_by_only"] > 0
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        names = set(f.keys())
        assert names == {f"model/{k}" for k in model.state_dict()}
        w = f.get_tensor("model/0.weight")
        state = json.loads(f.metadata()["ckptctl.state"])
    assert w.dtype == torch.bfloat16 and torch.equal(w, model[0].weight.detach().to(torch.bfloat16))
    assert set(state) == {"model"}  # the optimizer's structure and "extra" are left out with it


def test_refusals(tmp_path):
    src, _, _ = saved(tmp_path)
    assert convert(src, src, "--to", "ckptctl").exit_code == 2  # onto itself
    assert convert(src, os.path.join(src, "sub"), "--to", "dcp").exit_code == 2  # inside itself
    out = str(tmp_path / "o.pt")
    assert convert(src, out, "--to", "torch").exit_code == 0
    r = convert(src, out, "--to", "torch")
    assert r.exit_code == 1 and "--overwrite" in r.stderr
    assert convert(src, out, "--to", "torch", "--overwrite").exit_code == 0
    assert convert(src, str(tmp_path / "x"), "--to", "onnx").exit_code == 2
    assert convert(str(tmp_path / "missing"), str(tmp_path / "y"), "--to", "dcp").exit_code == 2
    os.unlink(os.path.join(src, MARKER))  # uncommitted: refused
    assert convert(src, str(tmp_path / "z"), "--to", "safetensors").exit_code == 1


def test_overwrite_refused_for_a_directory_inside_deletes_nothing(tmp_path):
    """--overwrite replaces another format's files, never a directory: refused, and the
    files beside that directory all still there (they were removed in listing order until the
    directory came up)."""
    src, _, _ = saved(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    names = {f"keep-{i:02d}.bin" for i in range(40)}
    for name in names:
        (out / name).write_bytes(name.encode())
    (out / "nested").mkdir()
    r = convert(src, str(out), "--to", "safetensors", "--overwrite")
    assert r.exit_code == 1 and "nested" in r.stderr, r.stderr
    assert set(os.listdir(out)) == names | {"nested"}
    assert all((out / name).read_bytes() == name.encode() for name in names)


@pytest.mark.parametrize("to,suffix", [("safetensors", ""), ("ckptctl", ""), ("torch", ".pt"), ("dcp", "")])
def test_convert_memory_is_bounded_by_the_largest_tensor(big_checkpoint, tmp_path, to, suffix):  # noqa: F811
    # DCP's own modules cost ~45 MiB to import: code, not data, so they count as baseline.
    base = baseline_mib(", torch.distributed.checkpoint" if to == "dcp" else "")
    out = str(tmp_path / f"out{suffix}")
    peak = peak_rss_mib(["-m", "ckptctl", "convert", big_checkpoint, out, "--to", to])
    bound = base + 2 * TENSOR_MIB + SLACK_MIB
    total = TENSORS * TENSOR_MIB
    print(f"convert ckptctl -> {to}: peak {peak:.0f} MiB, baseline {base:.0f} MiB, checkpoint {total} MiB")
    assert peak < bound, f"peak RSS {peak:.0f} MiB exceeds {bound:.0f} MiB for a {total} MiB checkpoint"
    if to == "ckptctl":
        return
    back = str(tmp_path / "back")
    peak = peak_rss_mib(["-m", "ckptctl", "convert", out, back, "--to", "ckptctl", "--step", "1"])  # torch files hold no step
    print(f"convert {to} -> ckptctl: peak {peak:.0f} MiB")
    assert peak < bound, f"peak RSS {peak:.0f} MiB reading {to} exceeds {bound:.0f} MiB for a {total} MiB checkpoint"


FSDP_SAVE = '''
import os, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict, StateDictOptions

out = sys.argv[1]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 30)).sum().backward()
opt.step()
msd, osd = get_state_dict(model, opt)
dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(out, "dcp"))
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(full, os.path.join(out, "reference.pt"))
dist.barrier()
dist.destroy_process_group()
'''


def test_dcp_from_fsdp2_on_4_gloo_ranks_converts_and_loads_into_one_rank(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "fsdp_save.py"
    script.write_text(FSDP_SAVE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script), str(tmp_path)]
    # This script is pure torch (FSDP2 + DCP make the fixture; no ckptctl code runs in it).
    # gloo sometimes aborts a rank at teardown when a peer closes its sockets first (CI saw
    # "exitcode: -6 (SIGABRT)" after the save had finished): a rank killed by a signal is
    # retried, a Python error (exit 1) fails at once.
    for _attempt in range(3):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode == 0 or "Signal 6 (SIGABRT)" not in p.stderr:
            break
    assert p.returncode == 0, p.stderr[-3000:]
    out = str(tmp_path / "ck")
    r = convert(str(tmp_path / "dcp"), out, "--to", "ckptctl", "--step", "1", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["source_format"] == "dcp" and r.json()["dropped"] == []
    model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(str(tmp_path / "unused")).load(out, {"model": model, "optimizer": opt})
    ref = torch.load(str(tmp_path / "reference.pt"), weights_only=True)
    assert ref.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(ref[k], v), k
    assert all("exp_avg" in s for s in opt.state.values())


def test_foreign_checkpoints_inspect_and_verify_saying_there_are_no_checksums(tmp_path):
    src, _, _ = saved(tmp_path)
    d, st, pt = str(tmp_path / "dcp"), str(tmp_path / "st"), str(tmp_path / "m.pt")
    for out, to in ((d, "dcp"), (st, "safetensors"), (pt, "torch")):
        assert convert(src, out, "--to", to).exit_code == 0
        doc = cli("inspect", out, "--tensors", "--json").json()
        assert doc["format"] == to and doc["tensor_count"] == 16 and not doc["checksums"]
        assert "model/0.weight" in {t["name"] for t in doc["tensors"]}
        r = cli("verify", out, "--load")
        assert r.exit_code == 0 and "no checksums" in r.stderr
    # A truncated DCP data file: coverage check names the file; exit 1.
    distcp = next(f for f in os.listdir(d) if f.endswith(".distcp"))
    with open(os.path.join(d, distcp), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, distcp)) // 2)
    r = cli("verify", d, "--json")
    assert r.exit_code == 1
    assert distcp in json.dumps(r.json()["checkpoints"][0]["problems"])
    # A pickle-needing .pt fails verification without running anything.
    marker = str(tmp_path / "PWNED")
    torch.save({"payload": Evil(marker)}, str(tmp_path / "evil.pt"))
    assert cli("verify", str(tmp_path / "evil.pt")).exit_code == 1
    assert not os.path.exists(marker)


def test_dcp_pickles_never_run(tmp_path):
    import pickle
    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "PWNED")
    d = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "payload": Evil(marker)}, checkpoint_id=d, no_dist=True)
    r = convert(d, str(tmp_path / "out"), "--to", "safetensors", "--json")
    assert r.exit_code == 0, r.stderr
    assert any("payload" in x and "pickle" in x for x in r.json()["dropped"])  # reported, not run
    assert not os.path.exists(marker)
    # A .metadata that is not DCP metadata (DCP's own reader would unpickle it as is).
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(Evil(marker), f)
    r = convert(d, str(tmp_path / "out2"), "--to", "safetensors")
    assert r.exit_code == 1 and ".metadata" in r.stderr and "refusing" in r.stderr
    assert not os.path.exists(marker)
