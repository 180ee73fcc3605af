"""Other stacks' files read defensively (trust issue, cases 7, 10 and 12): a FIFO never waited
on, a safetensors file or torch zip checked against its own header before a byte is copied,
zip members ckptctl cannot check refused as corrupt, deep JSON in every sidecar refused, and
one such checkpoint never failing a root-wide verb."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from typing import Any

import pytest
import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.layouts import safe_load
from ckptctl.storage.plain_file import open_plain
from ckptctl.layouts.classify import classify
from ckptctl.ops.transfer.copy import copy_found
from ckptctl.storage import open_storage
from helpers import cli
from test_foreign_trust import deadline
from test_layouts import deepspeed_tag, hf_checkpoint, megatron_iter

ROOT_VERBS = (["ls", "{root}"], ["latest", "{root}"], ["verify", "{root}", "--all"], ["prune", "{root}", "--keep-last", "1", "--dry-run"])


def at(path):
    """(storage, key) of a local file, as the layouts' readers take it."""
    import os

    from ckptctl.storage import open_storage

    path = str(path)
    return open_storage(os.path.dirname(os.path.abspath(path))), os.path.basename(path)


def two_hf(tmp_path: Any) -> tuple[str, str, str]:
    """A root with a good checkpoint-100 and a newer checkpoint-200 to be damaged."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    older = hf_checkpoint(root, 100)
    newest = hf_checkpoint(root, 200)
    return root, older, newest


def check_root_verbs(root: str, older: str) -> None:
    """Every root-wide verb finishes with 0 or 1 (never 3, never a traceback) and ``latest``
    names the older, good checkpoint."""
    for args in ROOT_VERBS:
        r = cli(*[a.format(root=root) for a in args])
        assert r.exit_code in (0, 1) and "Traceback" not in r.stderr, (args, r.exit_code, r.stdout, r.stderr)
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == older, (r.stdout, r.stderr)


# --- case 7: a FIFO where a Trainer file belongs --------------------------------------------

IN_A_CHILD = """
import json, sys
from typer.testing import CliRunner
from ckptctl.cli.app import app
out = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    out.append([r.exit_code, r.stdout + r.stderr])
print(json.dumps(out))
"""


def cli_in_a_child(*calls: list[str], timeout: float = 300) -> list[tuple[int, str]]:
    """Run CLI calls in one child process, killed if it blocks (a FIFO opened for reading
    blocks in C, where no signal handler of this process can interrupt it)."""
    p = subprocess.run([sys.executable, "-c", IN_A_CHILD, json.dumps(list(calls))], capture_output=True, text=True,
                       timeout=timeout, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert p.returncode == 0, p.stderr[-3000:]
    return [(code, text) for code, text in json.loads(p.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state.pth"])
def test_fifo_in_a_trainer_checkpoint_never_blocks_inspect_or_convert(tmp_path: Any, name: str) -> None:
    root, older, newest = two_hf(tmp_path)
    os.unlink(os.path.join(newest, name))
    os.mkfifo(os.path.join(newest, name))
    calls = [["inspect", newest], ["convert", newest, str(tmp_path / "out"), "--to", "ckptctl"],
             ["verify", newest], ["verify", newest, "--load"]]
    for args, (code, text) in zip(calls, cli_in_a_child(*calls)):
        assert code == 1 and name in text and "regular file" in text, (args, code, text)
    with deadline(120):
        check_root_verbs(root, older)


def test_open_plain_refuses_fifos_links_and_missing(tmp_path: Any) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"abc")
    os.symlink(tmp_path / "file", tmp_path / "link")
    with deadline(30):
        assert open_plain(str(tmp_path / "fifo")) is None
        assert open_plain(str(tmp_path / "link")) is None
        assert open_plain(str(tmp_path / "missing")) is None
        f = open_plain(str(tmp_path / "file"))
        assert f is not None
        with f:
            assert f.read() == b"abc"


# --- case 10: headers checked before copying -------------------------------------------------

def _copy(src_path: str, dst: str) -> tuple[int, Any]:
    """``cp`` through the library, counting every byte copied."""
    copied = [0]
    src = classify(src_path)
    assert src.what == "checkpoint"
    try:
        copy_found(src.in_layout, src.storage, open_storage(dst), lambda n: copied.__setitem__(0, copied[0] + n))
    except InvalidCheckpoint as e:
        return copied[0], e
    return copied[0], None


def test_trailing_bytes_after_safetensors_data_are_refused_before_copying(tmp_path: Any) -> None:
    root, older, newest = two_hf(tmp_path)
    with open(os.path.join(newest, "model.safetensors"), "ab") as f:
        f.write(bytes(64 << 10))  # zeros past the end of the last tensor
    copied, err = _copy(newest, str(tmp_path / "dst"))
    assert err is not None and "model.safetensors" in str(err) and "trailing" in str(err), err
    assert copied == 0 and not os.path.exists(tmp_path / "dst" / "checkpoint-200")
    for args in (["cp", newest, str(tmp_path / "dst2")], ["seal", newest], ["verify", newest, "--quick"]):
        r = cli(*args)
        assert r.exit_code == 1 and "trailing" in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    assert not os.path.exists(tmp_path / "dst2" / "checkpoint-200")
    assert not os.path.exists(os.path.join(newest, ".ckptctl-seal.json"))
    r = cli("restore", root, str(tmp_path / "dst3"), "--json")
    assert r.exit_code == 0 and "checkpoint-100" in r.stdout, r.stdout + r.stderr
    assert not os.path.exists(tmp_path / "dst3" / "checkpoint-200")


@pytest.mark.slow
def test_a_huge_sparse_safetensors_file_is_refused_from_its_header(tmp_path: Any) -> None:
    root, older, newest = two_hf(tmp_path)
    model = os.path.join(newest, "model.safetensors")
    os.truncate(model, os.path.getsize(model) + (100 << 30))  # 100 GB of sparse zeros: costs no disk
    with deadline(120):  # copying it first would take minutes
        copied, err = _copy(newest, str(tmp_path / "dst"))
        assert err is not None and "trailing" in str(err) and copied == 0
        r = cli("seal", newest)
        assert r.exit_code == 1 and "trailing" in r.stdout + r.stderr


def test_a_short_safetensors_file_is_refused(tmp_path: Any) -> None:
    root, older, newest = two_hf(tmp_path)
    model = os.path.join(newest, "model.safetensors")
    os.truncate(model, os.path.getsize(model) - 4)
    assert safe_load.safetensors_header(*at(model)) is not None
    r = cli("verify", newest, "--quick")
    assert r.exit_code == 1 and "model.safetensors" in r.stdout + r.stderr


def test_safetensors_header_accepts_real_files_and_refuses_gaps(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.zeros(3), "b": torch.ones(2, 2, dtype=torch.bfloat16), "e": torch.zeros(0)}, path,
              metadata={"format": "pt"})
    assert safe_load.safetensors_header(*at(path)) is None
    header = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    (tmp_path / "gap.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    assert "gap" in (safe_load.safetensors_header(*at(str(tmp_path / "gap.safetensors"))) or "")


def _rewrite_zip(path: str, change: str) -> None:
    """Alter a real ``torch.save`` zip the way the adversarial run did, keeping it otherwise
    consistent: compression method 99 (AES), the encrypted flag, a name that is not UTF-8,
    bytes inserted between two members, trailing bytes after the directory."""
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start_dir = z.start_dir
    target = infos[0]
    cd = raw.index(b"PK\x01\x02", start_dir)
    if change == "method 99":
        struct.pack_into("<H", raw, target.header_offset + 8, 99)
        struct.pack_into("<H", raw, cd + 10, 99)
    elif change == "encrypted":
        flags = struct.unpack_from("<H", raw, cd + 8)[0] | 1
        struct.pack_into("<H", raw, target.header_offset + 6, flags)
        struct.pack_into("<H", raw, cd + 8, flags)
    elif change == "not UTF-8":
        n = struct.unpack_from("<H", raw, cd + 28)[0]
        raw[cd + 46 + n - 1] = 0xFF
        raw[target.header_offset + 30 + n - 1] = 0xFF
    elif change == "gap":
        at = infos[1].header_offset
        raw[at:at] = bytes(16)
        # every later offset moves by 16: rewrite them so that only the gap is wrong
        pos = raw.index(b"PK\x01\x02", start_dir + 16)
        while raw[pos:pos + 4] == b"PK\x01\x02":
            off = struct.unpack_from("<I", raw, pos + 42)[0]
            if off >= at:
                struct.pack_into("<I", raw, pos + 42, off + 16)
            n, m, k = struct.unpack_from("<HHH", raw, pos + 28)
            pos += 46 + n + m + k
        eocd = raw.rindex(b"PK\x05\x06")
        struct.pack_into("<I", raw, eocd + 16, struct.unpack_from("<I", raw, eocd + 16)[0] + 16)
    elif change == "trailing":
        raw += bytes(4096)
    open(path, "wb").write(bytes(raw))


ZIP_CHANGES = ["method 99", "encrypted", "not UTF-8", "gap", "trailing"]


@pytest.mark.parametrize("change", ZIP_CHANGES)
def test_torch_zips_that_cannot_be_checked_are_corrupt_never_operational(tmp_path: Any, change: str) -> None:
    root, older, newest = two_hf(tmp_path)
    _rewrite_zip(os.path.join(newest, "optimizer.pt"), change)
    assert safe_load.zip_structure(*at(os.path.join(newest, "optimizer.pt"))) is not None
    for level in (["--quick"], [], ["--load"]):
        r = cli("verify", newest, *level)
        assert r.exit_code == 1 and "optimizer.pt" in r.stdout + r.stderr, (level, r.stdout, r.stderr)
    check_root_verbs(root, older)
    copied, err = _copy(newest, str(tmp_path / "dst"))
    assert err is not None and "optimizer.pt" in str(err) and copied == 0


def test_real_torch_zips_pass_the_structure_check(tmp_path: Any) -> None:
    for i, obj in enumerate([{"a": torch.zeros(100)}, torch.arange(10), {"x": [torch.ones(3), 1.5, "s"]}, {}]):
        path = str(tmp_path / f"f{i}.pt")
        torch.save(obj, path)
        assert safe_load.zip_structure(*at(path)) is None, path
        assert safe_load.zip_crc(*at(path))[0] is None
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/data.pkl", b"x" * 1000)
    assert safe_load.zip_structure(*at(str(tmp_path / "deflated.pt"))) is None
    assert safe_load.zip_crc(*at(str(tmp_path / "deflated.pt")))[0] is None


# --- case 12: deep or hostile JSON in every sidecar -----------------------------------------

DEEP = b"[" * 100_000 + b"1" + b"]" * 100_000


def test_deep_trainer_state_is_corrupt_and_skipped(tmp_path: Any) -> None:
    root, older, newest = two_hf(tmp_path)
    open(os.path.join(newest, "trainer_state.json"), "wb").write(b'{"global_step": 200, "log_history": ' + DEEP + b"}")
    r = cli("verify", newest)
    assert r.exit_code == 1 and "trainer_state.json" in r.stdout + r.stderr and "nested" in r.stdout + r.stderr
    check_root_verbs(root, older)
    r = cli("inspect", newest)
    assert r.exit_code == 1 and "trainer_state.json" in r.stderr


def test_deep_safetensors_header_is_corrupt_and_skipped(tmp_path: Any) -> None:
    root, older, newest = two_hf(tmp_path)
    header = b'{"__metadata__": {"x": ' + DEEP + b"}}"
    open(os.path.join(newest, "model.safetensors"), "wb").write(struct.pack("<Q", len(header)) + header)
    r = cli("verify", newest, "--quick")
    assert r.exit_code == 1 and "model.safetensors" in r.stdout + r.stderr
    check_root_verbs(root, older)


def test_hostile_megatron_integrity_json_is_corrupt_and_skipped(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    os.makedirs(root)
    megatron_iter(root, 1000)
    newest = megatron_iter(root, 2000)
    for doc in (DEEP, b'{"a": ' + b"9" * 5000 + b"}", b"\xff\xfe", b'{"x": NaN}'):
        open(os.path.join(newest, "integrity.json"), "wb").write(doc)
        r = cli("verify", newest)
        assert r.exit_code == 1 and "integrity.json" in r.stdout + r.stderr, (doc[:20], r.stdout, r.stderr)
        r = cli("ls", root)
        assert r.exit_code == 0, r.stderr


def test_trainer_state_with_nan_losses_is_still_good(tmp_path: Any) -> None:
    """Python's json writes a NaN loss as NaN: the Trainer's own file is read as it writes it."""
    root, older, newest = two_hf(tmp_path)
    open(os.path.join(newest, "trainer_state.json"), "w").write(
        '{"global_step": 200, "log_history": [{"loss": NaN, "grad_norm": Infinity}]}')
    r = cli("verify", newest, "--load")
    assert r.exit_code == 0, r.stdout + r.stderr


def test_deepspeed_latest_fifo_and_garbage(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    os.makedirs(root)
    deepspeed_tag(root, 10)
    deepspeed_tag(root, 20)
    with open(os.path.join(root, "latest"), "wb") as f:
        f.write(b"\xff" * 300)
    with deadline(60):
        for args in ROOT_VERBS:
            r = cli(*[a.format(root=root) for a in args])
            assert r.exit_code in (0, 1) and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)


def test_data_descriptors_must_repeat_the_sizes_not_the_crc(tmp_path: Any) -> None:
    """A record filled after it was laid out (ckptctl's own writer, before it patched data
    descriptors) keeps a stale descriptor CRC: its bytes are still checked against the
    directory's CRC; a descriptor whose sizes disagree is a broken archive."""
    path = str(tmp_path / "f.pt")
    torch.save({"w": torch.arange(8.0)}, path)
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    local_extra = struct.unpack_from("<H", raw, info.header_offset + 28)[0]
    data_end = info.header_offset + 30 + len(info.filename.encode()) + local_extra + info.compress_size
    assert raw[data_end:data_end + 4] == b"PK\x07\x08"
    stale = bytearray(raw)
    struct.pack_into("<I", stale, data_end + 4, 0xDEADBEEF)
    open(path, "wb").write(bytes(stale))
    assert safe_load.zip_structure(*at(path)) is None and safe_load.zip_crc(*at(path))[0] is None
    wrong = bytearray(raw)
    struct.pack_into("<I", wrong, data_end + 8, info.compress_size + 1)
    open(path, "wb").write(bytes(wrong))
    assert "descriptor" in (safe_load.zip_structure(*at(path)) or "")
    flipped = bytearray(raw)
    flipped[data_end - 1] ^= 0xFF
    open(path, "wb").write(bytes(flipped))
    assert safe_load.zip_structure(*at(path)) is None and "CRC-32" in (safe_load.zip_crc(*at(path))[0] or "")
