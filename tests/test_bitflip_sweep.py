"""Bit-flip sweep: one flipped bit anywhere in a committed checkpoint never yields wrong data.

Two small real checkpoints, each with steps 1 and 2: one saved by 1 rank (plain model), one by
2 ranks (FSDP2, so its tensors are split across the shards). Step 2 gets one bit flipped at a
time, in place: every byte of the marker, the manifest and every shard header (long runs of
digits and base64, RNG states mostly, strided), sampled data bytes (every chunk's first and
last among them), two bit values each. Every load path and verb runs on every flip:

- ``load_latest`` at the same world size (1 and 2 ranks), 2 -> 1 and 1 -> 2 (the 2-rank loads in
  two long-lived gloo ranks, ``bitflip_workers``), and ``Checkpointer.load(path)``;
- ``verify`` at each level, ``restore``, ``cp``, ``convert`` and ``reshard``, in-process through
  their ops functions (the CLI's exit code is the error's ``exit_code``).

Acceptable: the exact saved state of the step returned, a fallback to step 1 with exactly its
state, or a typed error of exit code 1 that left the caller's state as it was
(``bitflip_lib.judge``). A verb that succeeds must have produced exactly the saved content.
The sampled sweep runs by default; the full one (every header byte) is ``slow``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file

import bitflip_workers
from bitflip_lib import Flip, apply_flip, content, fingerprint, flips, job_state, judge, judge_output, save_two_steps, scramble, tally
from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import step_dir
from ckptctl.ops.verbs import convert_path, copy_to, reshard_path, restore_into
from ckptctl.layouts.checked import LEVELS
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.storage import open_storage

# Strides through the structural bytes (keys, punctuation, chunk index, offsets, digests,
# sizes, padding) and through long runs of digits and base64; prime, so that the two bit values
# of each byte move around. The exhaustive every-byte sweep of the same files is
# ``test_every_byte_of_marker_manifest_and_headers_is_bound`` (the gate every path goes through).
SAMPLED = {"loads": {"bulk_stride": 8001, "other_stride": 211, "data_samples": 4},
           "verbs": {"bulk_stride": 16001, "other_stride": 601, "data_samples": 2}}
FULL = {"loads": {"bulk_stride": 4001, "other_stride": 79, "data_samples": 6},
        "verbs": {"bulk_stride": 8001, "other_stride": 307, "data_samples": 4}}


@pytest.fixture(autouse=True)
def _quiet_fallbacks() -> Iterator[None]:
    # Every fallback warns, thousands of times. Restored afterwards: a level left on the
    # "ckptctl" logger would hide the warnings later tests assert on.
    logger = logging.getLogger("ckptctl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# The sweep in four parts, each a test of its own in the full sweep so that two xdist workers
# share it (one test of 85 s on CI before): the loads inside the two gloo ranks, of the 2-rank
# checkpoint and of the 1-rank one (``bitflip_workers`` families), and, in this process, the loads
# and verbs on the 1-rank checkpoint and on the 2-rank one. Each part builds both checkpoints
# afresh exactly as the whole sweep does (the ranks save the 2-rank one even when they load
# nothing) and runs the same flips on them: the parts together are the whole sweep.
RANK_PARTS = {"2-rank-in-2-ranks": "load_latest 2@2", "1-rank-in-2-ranks": "load_latest 1->2"}
WORLD_PARTS = {"1-rank-in-process": 1, "2-rank-in-process": 2}
PARTS = (*RANK_PARTS, *WORLD_PARTS)


def _sweep(base: str, density: dict[str, dict[str, int]], parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    root1, sweep1 = os.path.join(base, "root1"), os.path.join(base, "sweep1")
    state = job_state("plain", 1)
    with Checkpointer(root1) as ck:
        saved1 = save_two_steps(ck, state, "plain", 0, 1)
    shutil.copytree(root1, sweep1)
    fp1 = os.path.join(base, "fp1.json")
    with open(fp1, "w") as f:
        json.dump({str(k): v for k, v in saved1.items()}, f)
    worlds = [WORLD_PARTS[p] for p in parts if p in WORLD_PARTS]
    families = [RANK_PARTS[p] for p in parts if p in RANK_PARTS]
    report: dict[str, Any] = {}
    roots: dict[int, tuple[str, str, dict]] = {}
    if 1 in worlds:
        roots[1] = (root1, sweep1, saved1)
    if families or 2 in worlds:
        root2, sweep2 = os.path.join(base, "root2"), os.path.join(base, "sweep2")
        ranks = bitflip_workers.run({"root2": root2, "sweep2": sweep2, "fp1": fp1, "out": base, "sweep1": sweep1,
                                     "density": density["loads"], "families": families}, base, timeout=1500)
        for r, res in ranks.items():
            assert "error" not in res, res
            for fam, t in res.items():
                report[f"{fam} (rank {r})"] = t
        if 2 in worlds:
            with open(os.path.join(base, "fp2-rank0.json")) as f:
                saved2 = {int(k): v for k, v in json.load(f).items()}  # a 1-rank load gets rank 0's state
            roots[2] = (root2, sweep2, saved2)
    report.update(_in_process(base, roots, density))
    return report


def _in_process(base: str, roots: dict[int, tuple[str, str, dict]], density: dict[str, dict[str, int]]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    state = job_state("plain", 1, seed=3)
    work = os.path.join(base, "work")
    for world, (root, sweep, saved) in roots.items():
        pristine = {s: content(os.path.join(root, step_dir(s))) for s in (1, 2)}
        ckpt = os.path.join(sweep, step_dir(2))
        loads: dict[str, list[tuple[Flip, str]]] = {f"load_latest {world}->1": [], f"load {world}->1": []}
        with Checkpointer(sweep) as ck:
            for i, f in enumerate(flips(ckpt, **density["loads"])):
                apply_flip(ckpt, f)
                try:
                    scramble(state, 9000 + i)
                    loads[f"load_latest {world}->1"].append((f, judge(lambda: ck.load_latest(state, prepare=False), state, saved, before=None)))
                    scramble(state, 9000 + i)
                    before = fingerprint(state)
                    loads[f"load {world}->1"].append((f, judge(lambda: ck.load(ckpt, state), state, {2: saved[2]}, before=before)))
                finally:
                    apply_flip(ckpt, f)
        report.update({k: tally(v) for k, v in loads.items()})
        verbs: dict[str, list[tuple[Flip, str]]] = {}
        for f in flips(ckpt, **density["verbs"]):
            apply_flip(ckpt, f)
            try:
                for name, outcome in _verbs(ckpt, sweep, world, pristine, work, f):
                    verbs.setdefault(f"{name} ({world}-rank)", []).append((f, outcome))
            finally:
                apply_flip(ckpt, f)
        report.update({k: tally(v) for k, v in verbs.items()})
    return report


def _verbs(ckpt: str, root: str, world: int, pristine: dict[int, dict], work: str, flip: Flip) -> list[tuple[str, str]]:
    """Every verb on the (flipped) step-2 checkpoint ``ckpt`` under ``root``, judged. ``verify
    --quick`` reads no tensor data by definition: its "ok" on a flipped data byte is right."""
    out = []

    def same(path: str, step: int, *, ranks: bool = True) -> str | None:
        got, want = content(path, ranks=ranks), dict(pristine[step])
        if not ranks:
            want.pop("ranks")
        return None if got == want else f"content differs from step {step}'s: {[k for k in want if got.get(k) != want[k]]}"

    for level in LEVELS:
        def run_verify(level=level) -> None:
            rep = verify_checkpoint(open_storage(ckpt), level)
            if not rep.ok:
                raise InvalidCheckpoint("; ".join(str(p) for p in rep.problems))
        quick_on_data = level == "quick" and flip.region == "data"
        out.append((f"verify {level}", judge_output(run_verify, lambda _: None if quick_on_data else same(ckpt, 2))))

    def fresh() -> str:
        shutil.rmtree(work, ignore_errors=True)
        return work

    out.append(("cp", judge_output(lambda: copy_to(ckpt, fresh()), lambda r: same(r.path, 2))))
    out.append(("restore", judge_output(lambda: restore_into(root, fresh()), lambda r: same(r.path, r.step))))

    def converted(_: Any) -> str | None:
        got: dict[str, torch.Tensor] = {}
        for n in sorted(os.listdir(work)):
            if n.endswith(".safetensors"):
                got.update(load_file(os.path.join(work, n)))
        want = pristine[2]["tensors"]
        from ckptctl.format.checksum import digest
        have = {k: digest(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for k, v in got.items()}
        return None if have == want else f"converted tensors differ: {sorted(set(have) ^ set(want))[:3] or [k for k in want if have[k] != want[k]][:3]}"

    out.append(("convert", judge_output(lambda: convert_path(ckpt, fresh(), "safetensors"), converted)))
    target = os.path.join(work, step_dir(2))
    out.append(("reshard", judge_output(lambda: (fresh(), reshard_path(ckpt, target, 3 - world)),
                                        lambda _: same(target, 2, ranks=False))))
    shutil.rmtree(work, ignore_errors=True)
    return out


def _check(report: dict[str, Any], base: str) -> None:
    with open(os.path.join(base, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nbit-flip sweep ({base}/report.json): family: tried {{region: {{outcome: count}}}}")
    for fam, t in report.items():
        print(f"  {fam}: {t['tried']} {json.dumps(t['counts'], sort_keys=True)}")
    bad = {fam: t["bad"] for fam, t in report.items() if t["bad"]}
    assert not bad, json.dumps(bad, indent=1)
    assert report and all(t["tried"] for t in report.values())


def test_bitflip_sweep_sampled(tmp_path):
    base = str(tmp_path)
    _check(_sweep(base, SAMPLED), base)


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_bitflip_sweep_full(tmp_path, part):
    base = str(tmp_path)
    _check(_sweep(base, FULL, (part,)), base)


# --- every byte, at the gate ------------------------------------------------------------------


def _gate_sweep(ckpt: str) -> dict[str, Any]:
    """Every byte of the marker, the manifest and every shard header, two bits each, through
    the checks every reader makes before it uses a field: the marker and the manifest it
    commits (``layouts.native_read.read_committed``), then each header parsed and bound to the
    manifest's file entry (size, ``format.shard_identity.header_mismatch``), as
    ``load.shard_index`` and ``layouts.shard_scan`` do. A flip must be refused there, or (the
    marker's informational fields only) leave every field that is used unchanged."""
    from ckptctl.format.shard import parse_header
    from ckptctl.format.shard_identity import header_mismatch
    from ckptctl.layouts.native_read import read_committed

    store = open_storage(ckpt)
    manifest, marker = read_committed(store)
    results: list[tuple[Flip, str]] = []
    for f in flips(ckpt, bulk_stride=1, other_stride=1, data_samples=0):
        if f.region == "data":
            continue
        if f.region in ("marker", "manifest"):
            apply_flip(ckpt, f)
            try:
                m2, k2 = read_committed(store)
                used = (k2.step, k2.manifest_size, k2.manifest_checksum, k2.manifest_name)
                same = m2 == manifest and used == (marker.step, marker.manifest_size, marker.manifest_checksum, marker.manifest_name)
                out = "accepted-unchanged" if same else "BAD:accepted-changed"
            except InvalidCheckpoint:
                out = "refused"
            finally:
                apply_flip(ckpt, f)
            results.append((f, out))
            continue
        with open(os.path.join(ckpt, f.file), "rb") as fh:
            raw = bytearray(fh.read())
        entry = next(e for e in manifest.files if e.name == f.file)
        raw[f.offset] ^= 1 << f.bit
        try:
            h = parse_header(bytes(raw), len(raw), f.file)
            bound = h.data_start + h.data_size == entry.size and header_mismatch(h, entry) is None
            out = "BAD:accepted" if bound else "refused"
        except InvalidCheckpoint:
            out = "refused"
        results.append((f, out))
    return tally(results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])  # a test each, so that two xdist workers share them
def test_every_byte_of_marker_manifest_and_headers_is_bound(tmp_path, world):
    from ckptctl.ops.transform.reshard import reshard

    state = job_state("plain", 1)
    with Checkpointer(str(tmp_path / "root")) as ck:
        save_two_steps(ck, state, "plain", 0, 1)
    ckpt = os.path.join(str(tmp_path / "root"), step_dir(2))
    if world == 2:
        two = os.path.join(str(tmp_path / "two"), step_dir(2))
        reshard(open_storage(ckpt), open_storage(two), 2, split_bytes=1)
        ckpt = two
    _check({f"gate {world}-rank": _gate_sweep(ckpt)}, str(tmp_path))
