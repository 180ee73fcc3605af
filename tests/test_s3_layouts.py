"""Every layout on object storage, read as on a local root: the acceptance test for other
tools' checkpoints working on ``s3://`` (each layout reading through the ``Storage`` interface).

For each of the six layouts (ckptctl's own, torchtitan/DCP, the Hugging Face Trainer,
Megatron-LM, DeepSpeed, Lightning) a local root gets three committed checkpoints (steps 10, 20,
30; Megatron's tracker and DeepSpeed's ``latest`` name 30, the Trainer's and Lightning's best
is 10) and an interrupted newest save (step 40, by that stack's own notion of unfinished). The
root reaches the bucket two ways:

- ``sync``: sealed (ckptctl's own need no seal; sealing lets each copied byte be checked against
  the seal on the way) and mirrored with ``ckptctl sync``, which copies committed
  checkpoints only; the unfinished step 40 is then put beside them with boto3, as an upload
  still in progress leaves it.
- ``upload``: every file put with boto3, byte for byte, unsealed: the layouts' own readers on
  S3, without a seal to lean on and without sync in the way (reading verbs only, for time).

Step 30 is then damaged the same way on both sides (a byte flipped inside a torch zip record
or a ckptctl shard, a DCP record file cut short) so that the default verification level catches
it, and the reading verbs (ls, latest --json, verify --latest, du) must give the same answer on
the bucket as on the local root, compared as a projection without URLs. Then, on the uploaded
copy, prune --keep-last 1 --dry-run; on the synced copy, a restore of the bucket to a new local
directory that verifies, and a real prune --keep-last 1 (the same plan either way: step 20 the
anchor; the damaged 30, a pointer's target, and the fresh partial 40 never deleted; a best kept).
Lightning: its interrupted save is a truncated ``.ckpt``; ``restore`` does not copy one-file
checkpoints (a usage error, exit 2, on either side, as documented).

The last test uploads a complete checkpoint without its commit file (what an upload killed
before its last PUT leaves) and checks that it is partial and never the latest.

Both run on a general-purpose bucket and on an S3 Express One Zone directory bucket (emulated,
``express_url``), whose listings come in no order and take only "/"-ended prefixes.
"""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import boto3
import pytest
import torch
from botocore.config import Config

from ckptctl.format.layout import MARKER
from helpers import cli, make_checkpoints
from test_layouts import dcp_step, deepspeed_tag, hf_checkpoint, megatron_iter

STEPS = (10, 20, 30)
PARTIAL = 40
CORRUPT = 30  # the newest committed checkpoint, damaged after it was mirrored
GOOD = 20  # what latest, verify --latest, prune's anchor and restore must all land on


# --- the six layouts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    name: str  # as ls's FORMAT column and --format spell it
    build: Callable[[str, int], None]  # one committed checkpoint; pointer (if any) names it
    interrupted: Callable[[str, int], None]  # the stack's own unfinished save
    entry: Callable[[int], str]  # the checkpoint's name under its root
    commit_file: Callable[[int], str | None]  # root-relative: the object whose absence uncommits it
    damaged_file: Callable[[str, int], str]  # (root, step) -> root-relative file that step 30 damage hits
    damage: Callable[[bytes], bytes]
    pointer: str | None = None  # root-relative pointer file (Megatron tracker, DeepSpeed latest)
    best: int | None = None  # the step a best-checkpoint record names (kept by prune)
    restorable: bool = True  # restore copies a checkpoint of this layout


def _flip_in_zip_record(data: bytes) -> bytes:
    """One byte inverted in the middle of the largest tensor record of a ``torch.save`` zip:
    same size, zip directory intact, so only the record's CRC-32 (or a seal) tells."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        rec = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len = int.from_bytes(data[rec.header_offset + 26:rec.header_offset + 28], "little")
    extra_len = int.from_bytes(data[rec.header_offset + 28:rec.header_offset + 30], "little")
    at = rec.header_offset + 30 + name_len + extra_len + rec.file_size // 2
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def _flip_near_end(data: bytes) -> bytes:
    """A safetensors shard's last bytes are tensor data: one of them inverted."""
    out = bytearray(data)
    out[-10] ^= 0xFF
    return bytes(out)


def _cut_in_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _only(root: str, rel_dir: str, suffix: str) -> str:
    (name,) = [n for n in os.listdir(os.path.join(root, rel_dir)) if n.endswith(suffix)]
    return f"{rel_dir}/{name}"


# ckptctl's own: Checkpointer.save, COMMITTED written last.
def _native_name(step: int) -> str:
    return f"step-{step:010d}"


def _native_build(root: str, step: int) -> None:
    make_checkpoints(root, [step], size=64, tensors=2)


def _native_interrupted(root: str, step: int) -> None:
    make_checkpoints(root, [step], size=64, tensors=2)
    os.unlink(os.path.join(root, _native_name(step), MARKER))  # killed before the marker


# Lightning: one torch.save file per checkpoint; a file cut short is its own unfinished save.
def _lightning_name(step: int) -> str:
    return f"epoch=0-step={step}.ckpt"


def _lightning_build(root: str, step: int) -> None:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")
    from test_protection import _lightning_file

    state = {"best_model_path": os.path.join(root, _lightning_name(10)), "best_model_score": torch.tensor(1.0)}
    _lightning_file(root, step, callbacks={"ModelCheckpoint{'monitor': 'score'}": state})


def _lightning_interrupted(root: str, step: int) -> None:
    # _atomic_save's move across filesystems killed mid-copy: a truncated .ckpt (partial).
    _lightning_build(root, step)
    path = os.path.join(root, _lightning_name(step))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


STACKS: dict[str, Stack] = {s.name: s for s in [
    Stack("ckptctl", _native_build, _native_interrupted, _native_name,
          commit_file=lambda s: f"{_native_name(s)}/{MARKER}",
          damaged_file=lambda root, s: _only(root, _native_name(s), ".safetensors"), damage=_flip_near_end),
    Stack("dcp", lambda r, s: dcp_step(r, s) and None, lambda r, s: dcp_step(r, s, complete=False) and None,
          lambda s: f"step-{s}", commit_file=lambda s: f"step-{s}/.metadata",
          damaged_file=lambda root, s: _only(root, f"step-{s}", ".distcp"), damage=_cut_in_half),
    Stack("hf-trainer",
          lambda r, s: hf_checkpoint(r, s, best=os.path.join(r, "checkpoint-10")) and None,
          lambda r, s: hf_checkpoint(r, s, best=os.path.join(r, "checkpoint-10"), state=False) and None,
          lambda s: f"checkpoint-{s}", commit_file=lambda s: f"checkpoint-{s}/trainer_state.json",
          damaged_file=lambda root, s: f"checkpoint-{s}/optimizer.pt", damage=_flip_in_zip_record, best=10),
    Stack("megatron", lambda r, s: megatron_iter(r, s) and None,
          lambda r, s: megatron_iter(r, s, tracker=False) and None,
          lambda s: f"iter_{s:07d}", commit_file=lambda s: None,  # the tracker, which stays behind
          damaged_file=lambda root, s: f"iter_{s:07d}/mp_rank_00/model_optim_rng.pt", damage=_flip_in_zip_record,
          pointer="latest_checkpointed_iteration.txt"),
    Stack("deepspeed", lambda r, s: deepspeed_tag(r, s) and None,
          lambda r, s: deepspeed_tag(r, s, latest=False) and None,
          lambda s: f"global_step{s}", commit_file=lambda s: None,  # `latest`, which stays behind
          damaged_file=lambda root, s: f"global_step{s}/mp_rank_00_model_states.pt", damage=_flip_in_zip_record,
          pointer="latest"),
    Stack("lightning", _lightning_build, _lightning_interrupted, _lightning_name,
          commit_file=lambda s: _lightning_name(s),  # the whole file is one PUT: see the last test
          damaged_file=lambda root, s: _lightning_name(s), damage=_flip_in_zip_record, best=10,
          # `restore` does not copy Lightning files (ckptctl restore --help): exit 2 on either side
          restorable=False),
]}

LAYOUTS = list(STACKS)


# --- the bucket, seen raw ----------------------------------------------------------------------


class Bucket:
    def __init__(self, s3_server: str, url: str) -> None:
        # Straight to moto; on a directory bucket too, without the session botocore would ask.
        self.client = boto3.client("s3", endpoint_url=s3_server,
                                   config=Config(s3={"disable_s3_express_session_auth": True}))
        self.url = url
        self.bucket, _, self.prefix = url[len("s3://"):].partition("/")

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def put(self, rel: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body)

    def get(self, rel: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def names(self) -> set[str]:
        out: set[str] = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            out.update(o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", []))
        return out

    def upload(self, local_root: str, under: str = "", skip: set[str] = frozenset()) -> list[str]:
        """Put every file of ``local_root/under`` at the same relative key, byte for byte
        (ckptctl's own root-level bookkeeping, ``.ckptctl-*``, stays behind)."""
        start = os.path.join(local_root, under) if under else local_root
        done = []
        if os.path.isfile(start):
            files = [under]
        else:
            files = []
            for dirpath, _dirs, names in os.walk(start):
                for n in names:
                    files.append(os.path.relpath(os.path.join(dirpath, n), local_root).replace(os.sep, "/"))
        for rel in sorted(files):
            if rel in skip or ("/" not in rel and rel.startswith(".ckptctl-")):
                continue
            with open(os.path.join(local_root, rel), "rb") as f:
                self.put(rel, f.read())
            done.append(rel)
        return done


def _local_files(root: str, under: str) -> list[str]:
    path = os.path.join(root, under)
    if os.path.isfile(path):
        return [under]
    return sorted(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                  for d, _s, names in os.walk(path) for n in names)


def _damage_both(stack: Stack, local: str, bucket: Bucket, step: int) -> str:
    """The same damage to the same file on each side; returns its root-relative name."""
    rel = stack.damaged_file(local, step)
    path = os.path.join(local, rel)
    with open(path, "rb") as f:
        before = f.read()
    after = stack.damage(before)
    assert after != before
    with open(path, "wb") as f:
        f.write(after)
    remote = bucket.get(rel)
    assert remote == before, f"{rel} on the bucket is not the local file's copy"
    bucket.put(rel, after)
    return rel


# --- normalised views of each verb's --json --------------------------------------------------


def _name(url: str | None) -> str | None:
    return None if url is None else url.rstrip("/").rsplit("/", 1)[-1]


def _sub(value: Any, root: str) -> Any:
    """Every occurrence of the root's URL replaced by ROOT, everywhere in a JSON value."""
    if isinstance(value, str):
        return value.replace(root.rstrip("/"), "ROOT")
    if isinstance(value, list):
        return [_sub(v, root) for v in value]
    if isinstance(value, dict):
        return {k: _sub(v, root) for k, v in value.items()}
    return value


def _doc(r) -> dict:
    try:
        return r.json()
    except ValueError:
        raise AssertionError(f"not one JSON document (exit {r.exit_code}):\n{r.stdout}\n{r.stderr}") from None


def view_ls(root: str) -> dict:
    r = cli("ls", root, "--json")
    doc = _doc(r)
    return {"exit": r.exit_code, "counts": doc.get("counts"),
            "checkpoints": [(c["name"], c["step"], c["layout"], c["status"], c["bytes"]) for c in doc.get("checkpoints", [])]}


def view_latest(root: str) -> dict:
    r = cli("latest", root, "--json")
    doc = _doc(r)
    if "error" in doc:
        return {"exit": r.exit_code, "error": doc["error"]["type"]}
    resume = _sub(doc.get("resume") or {}, root)
    return {"exit": r.exit_code, "name": _name(doc.get("url")), "step": doc.get("step"), "layout": doc.get("layout"),
            "level": doc.get("level"), "resume": {k: resume.get(k) for k in ("path", "argv", "exact")},
            "skipped": [(_name(s["url"]), s["step"], s["ok"]) for s in doc.get("skipped", [])]}


def view_latest_plain(root: str) -> dict:
    r = cli("latest", root)
    return {"exit": r.exit_code, "path": _sub(r.stdout.strip(), root)}


def _problem_files(report: dict) -> list:
    return sorted({str(p.get("file")) for p in report.get("problems", []) if isinstance(p, dict)})


def view_verify_latest(root: str) -> dict:
    """(``_text``: every problem's text, for reading, left out of comparisons by ``_cmp``.)"""
    r = cli("verify", root, "--latest", "--json")
    doc = _doc(r)
    if "error" in doc:
        return {"exit": r.exit_code, "error": doc["error"]["type"]}
    text = "\n".join(str(p.get("text") or p.get("message")) if isinstance(p, dict) else str(p)
                     for c in doc.get("checkpoints", []) for p in c.get("problems", []))
    return {"_text": text, "exit": r.exit_code, "ok": doc.get("ok"), "level": doc.get("level"),
            "checkpoints": [(_name(c["url"]), c["step"], c["ok"], _problem_files(c)) for c in doc.get("checkpoints", [])],
            "pointers": [(p.get("layout"), _name(p.get("pointer")), p.get("value"), p.get("step"), p.get("ok"),
                          (p.get("verifies") or {}).get("step")) for p in doc.get("pointers", [])]}


def view_du(root: str) -> dict:
    r = cli("du", root, "--json")
    doc = _doc(r)
    return {"exit": r.exit_code, "bytes": doc.get("bytes"),
            "checkpoints": [(c["name"], c["step"], c["layout"], c["status"], c["bytes"]) for c in doc.get("checkpoints", [])]}


def view_prune(root: str, *args: str) -> dict:
    r = cli("prune", root, "--keep-last", "1", *args, "--json")
    doc = _doc(r)
    if "error" in doc:
        return {"exit": r.exit_code, "error": doc["error"]["type"]}
    plan = doc["plan"]
    return {"exit": r.exit_code, "anchor": (plan.get("anchor") or {}).get("step"), "refused": plan.get("refused") is not None,
            "items": [(i["name"], i["step"], i["status"], i["layout"], i["action"]) for i in plan["items"]]}


def _cmp(view: dict) -> dict:
    """The view without the keys kept for reading only (``_text``)."""
    return {k: v for k, v in view.items() if not k.startswith("_")}


def _actions(view: dict) -> dict[int, str]:
    return {step: action for _name, step, _kind, _layout, action in view["items"]}


def _check_plan(stack: Stack, plan: dict) -> None:
    """prune --keep-last 1: step 20 is the anchor; the damaged 30 (newer than the anchor, and
    a pointer's target) and the fresh partial 40 are never deleted; a best is kept."""
    assert "error" not in plan and plan["anchor"] == GOOD, plan
    acts = _actions(plan)
    assert acts[GOOD] == "keep" and acts[CORRUPT] != "delete" and acts[PARTIAL] != "delete", plan
    assert acts[10] == ("keep" if stack.best == 10 else "delete"), plan


# --- the comparison ------------------------------------------------------------------------------


def _build_root(stack: Stack, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    for s in STEPS:
        stack.build(root, s)  # in step order: a pointer file ends up naming step 30
    stack.interrupted(root, PARTIAL)


def _to_bucket(stack: Stack, how: str, local: str, bucket: Bucket) -> None:
    if how == "upload":
        bucket.upload(local)
        return
    r = cli("seal", local, "--json")  # cp/sync to object storage carry a seal; ckptctl's own need none
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("sync", local, bucket.url, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    copied = {c["name"] for c in doc["checkpoints"] if c["action"] == "copied"}
    assert copied == {stack.entry(s) for s in STEPS}, doc  # committed only, the unfinished save not
    assert doc["counts"]["failed"] == 0, doc
    # A byte-for-byte mirror of every committed checkpoint (its seal too) and of the pointer.
    for s in STEPS:
        for rel in _local_files(local, stack.entry(s)):
            with open(os.path.join(local, rel), "rb") as f:
                assert bucket.get(rel) == f.read(), f"{rel} not mirrored as it is"
    assert not any(n.startswith(stack.entry(PARTIAL)) for n in bucket.names())
    if stack.pointer:
        with open(os.path.join(local, stack.pointer), "rb") as f:
            assert bucket.get(stack.pointer) == f.read(), f"{stack.pointer} not mirrored"
    # The newest save is still being written (locally) / uploaded: its files, no commit.
    bucket.upload(local, stack.entry(PARTIAL))


# A general-purpose bucket both ways; a directory bucket (S3 Express One Zone, emulated: see
# s3_directory_bucket) synced, whose run holds every verb the upload's does (for time).
@pytest.mark.parametrize(("how", "kind"), [("sync", "s3_url"), ("upload", "s3_url"), ("sync", "express_url")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_bucket_reads_as_the_local_root_it_mirrors(layout, how, kind, request, s3_server, tmp_path):
    stack = STACKS[layout]
    local = str(tmp_path / "local")
    _build_root(stack, local)
    remote = request.getfixturevalue(kind)
    bucket = Bucket(s3_server, remote)
    _to_bucket(stack, how, local, bucket)
    _damage_both(stack, local, bucket, CORRUPT)
    names = {s: stack.entry(s) for s in (*STEPS, PARTIAL)}

    # ls: same checkpoints, same layout, same status, same sizes. Damaged bytes do not change a
    # status (ls reads no data); the unfinished save is partial by the stack's own rule.
    here, there = view_ls(local), view_ls(remote)
    assert here["exit"] == 0 and [(c[0], c[2], c[3]) for c in here["checkpoints"]] == [
        (names[10], layout, "committed"), (names[20], layout, "committed"), (names[30], layout, "committed"),
        (names[40], layout, "partial")], here
    assert there == here

    # latest: the damaged step 30 is skipped on both sides, step 20 chosen, same resume argv.
    here, there = view_latest(local), view_latest(remote)
    assert here["exit"] == 0 and here["step"] == GOOD and here["name"] == names[GOOD], here
    assert [s[1] for s in here["skipped"]] == [CORRUPT], here
    if stack.pointer:  # the pointer names the damaged step 30: resuming ROOT would not load 20
        assert here["resume"]["exact"] is False and here["resume"]["path"] == "ROOT", here
    else:
        assert here["resume"]["exact"] is True and here["resume"]["path"] == f"ROOT/{names[GOOD]}", here
    assert there == here

    # verify --latest: 30 fails (the damaged file named), 20 verifies; the newest failing fails
    # the run, pointer or not (a pointer naming 30 is named too).
    here, there = view_verify_latest(local), view_verify_latest(remote)
    assert [(c[1], c[2]) for c in here.get("checkpoints", [])] == [(CORRUPT, False), (GOOD, True)], here
    damaged = os.path.basename(stack.damaged_file(local, CORRUPT))
    assert damaged in here["_text"] and damaged in there.get("_text", ""), (here, there)
    assert here["exit"] == 1 and here["ok"] is False, here
    if stack.pointer:
        assert [(p[3], p[4], p[5]) for p in here["pointers"]] == [(CORRUPT, False, GOOD)], here
    else:
        assert not here["pointers"], here
    assert _cmp(there) == _cmp(here)

    # du: same sizes, same statuses.
    here, there = view_du(local), view_du(remote)
    assert here["exit"] == 0 and [c[1] for c in here["checkpoints"]] == [*STEPS, PARTIAL], here
    assert there == here

    if how == "upload":
        # prune --dry-run (here; the synced copy is pruned for real below): the same plan.
        here, there = view_prune(local, "--dry-run"), view_prune(remote, "--dry-run")
        _check_plan(stack, here)
        assert there == here
        return  # the writing verbs (restore, a real prune) run on the synced copy: time

    # restore the bucket (and, for comparison, the local root) to new local directories.
    dst_s3, dst_local = str(tmp_path / "restored-from-s3"), str(tmp_path / "restored-from-local")
    r_s3, r_local = cli("restore", remote, dst_s3, "--json"), cli("restore", local, dst_local, "--json")
    if not stack.restorable:
        assert r_local.exit_code == 2 and r_s3.exit_code == 2, r_s3.stdout + r_s3.stderr
    else:
        assert r_local.exit_code == 0, r_local.stdout + r_local.stderr
        assert r_s3.exit_code == 0, r_s3.stdout + r_s3.stderr
        assert r_s3.json()["step"] == r_local.json()["step"] == GOOD
        assert _sub(r_s3.json()["path"], dst_s3) == _sub(r_local.json()["path"], dst_local)
        v = cli("verify", dst_s3, "--latest", "--json")
        assert v.exit_code == 0 and v.json()["ok"], v.stdout + v.stderr
        assert [c["step"] for c in v.json()["checkpoints"]] == [GOOD], v.stdout
        assert [(c[0], c[3]) for c in view_ls(dst_s3)["checkpoints"]] == [(names[GOOD], "committed")]

    # prune for real, on each side: the same plan and outcome, the same checkpoints left.
    here, there = view_prune(local, "--yes"), view_prune(remote, "--yes")
    _check_plan(stack, here)
    assert there == here
    left_here, left_there = view_ls(local), view_ls(remote)
    assert left_there == left_here
    kept = {c[1] for c in left_here["checkpoints"]}
    assert {GOOD, CORRUPT, PARTIAL} <= kept, left_here
    assert (10 in kept) == (stack.best == 10), left_here
    if stack.pointer:  # prune never moves or removes a stack's pointer: it still names 30
        with open(os.path.join(local, stack.pointer), "rb") as f:
            assert f.read().strip().endswith(b"30") and bucket.get(stack.pointer).strip().endswith(b"30")


# --- an upload killed before its commit ------------------------------------------------------------

LATE = 50


@pytest.mark.parametrize("kind", ["s3_url", "express_url"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_upload_without_its_commit_file_is_partial_and_never_latest(layout, kind, request, s3_server, tmp_path):
    """Every file of a complete checkpoint on the bucket but the one its stack's commit rule
    reads (ckptctl's marker, DCP's .metadata, the Trainer's trainer_state.json; Megatron's
    tracker and DeepSpeed's ``latest`` not moved to it): what a copy killed before its last
    PUT leaves. A Lightning file is one object: a killed upload of it is an unfinished
    multipart upload, which S3 does not list at all."""
    stack = STACKS[layout]
    s3_url = request.getfixturevalue(kind)
    local = str(tmp_path / "local")
    os.makedirs(local)
    for s in (10, 20):
        stack.build(local, s)
    bucket = Bucket(s3_server, s3_url)
    bucket.upload(local)
    stack.build(local, LATE)  # complete here (a local pointer now names it)
    name = stack.entry(LATE)
    if layout == "lightning":
        with open(os.path.join(local, name), "rb") as f:
            data = f.read()
        up = bucket.client.create_multipart_upload(Bucket=bucket.bucket, Key=bucket.key(name))
        bucket.client.upload_part(Bucket=bucket.bucket, Key=bucket.key(name), UploadId=up["UploadId"], PartNumber=1,
                                  Body=data[: len(data) // 2])
    else:
        commit = stack.commit_file(LATE)
        sent = bucket.upload(local, name, skip={commit} if commit else set())
        assert sent and commit not in sent
        if stack.pointer:
            assert bucket.get(stack.pointer).strip() in (b"20", b"global_step20")  # still the old target

    rows = {c[1]: c[3] for c in view_ls(s3_url)["checkpoints"]}
    if layout == "lightning":
        assert rows == {10: "committed", 20: "committed"}, rows
    else:
        assert rows == {10: "committed", 20: "committed", LATE: "partial"}, rows
    plain = view_latest_plain(s3_url)  # the pointer (if any) names 20: a path, exit 0
    assert plain["exit"] == 0 and plain["path"] == ("ROOT" if stack.pointer else f"ROOT/{stack.entry(20)}"), plain
    v = view_verify_latest(s3_url)
    assert v["exit"] == 0 and v["ok"] is True and [(c[1], c[2]) for c in v["checkpoints"]] == [(20, True)], v
    # (prune leaving such a fresh partial upload alone is step 40 of the test above)
