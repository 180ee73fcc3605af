"""The bit-flip sweep's parts: which bytes to flip, the jobs that make the checkpoints, the
exact state each step saved, and how one outcome is judged.

An outcome is acceptable only as one of: the exact saved state of the step returned (``new``),
a fallback to the previous step with exactly its state (``old``), or a clear error (a typed
ckptctl error of exit code 1, the caller's state unchanged: ``refused``). Anything else is
``BAD:...`` (silent wrong data, a state half applied, an untyped exception, exit 2 or 3).

Used in-process by tests/test_bitflip_sweep.py and inside the long-lived ranks of
tests/bitflip_workers.py.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ckptctl.errors import CkptError
from ckptctl.format.checksum import digest


class Loader:
    """A data loader position, saved through state_dict/load_state_dict."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict) -> None:
        self.pos = d["pos"]


@dataclass(frozen=True)
class Flip:
    file: str  # relative to the checkpoint directory
    offset: int
    bit: int
    region: str  # marker | manifest | header | data


# Long runs of digits, list commas and base64 (RNG states, per-rank tensors): flipping every
# byte of them tells nothing the first few of a run do not, so a sampled sweep strides them.
_BULK = re.compile(rb"[0-9A-Za-z+/=,.\- ]{48,}")


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def flips(ckpt: str, *, bulk_stride: int, other_stride: int = 1, data_samples: int = 24) -> list[Flip]:
    """The flips of one checkpoint directory: every ``other_stride``-th byte of its marker,
    manifest and shard headers (every ``bulk_stride``-th inside long runs of digits and base64),
    and ``data_samples`` data bytes per shard (the first and last of every chunk among them);
    two bit values per byte."""
    out: list[Flip] = []

    def add(name: str, offsets: Iterable[int], region: str) -> None:
        for i in offsets:
            for bit in sorted({i % 8, (i + 5) % 8}):
                out.append(Flip(name, i, bit, region))

    def text(name: str, raw: bytes, base: int, region: str) -> None:
        bulk = [False] * len(raw)
        starts: dict[int, int] = {}
        for m in _BULK.finditer(raw):
            for i in range(m.start(), m.end()):
                bulk[i] = True
                starts[i] = m.start()
        add(name, [base + i for i in range(len(raw))
                   if (not bulk[i] and i % other_stride == 0) or (bulk[i] and (i - starts[i]) % bulk_stride == 0)], region)

    for name in sorted(os.listdir(ckpt)):
        path = os.path.join(ckpt, name)
        with open(path, "rb") as f:
            raw = f.read()
        if name.endswith(".safetensors"):
            n = _header_len(path)
            text(name, raw[:n], 0, "header")
            hdr = json.loads(raw[8:n])
            # Chunk edges (a chunk's first and last byte) and evenly spread bytes, half each.
            ends = sorted({n + v["data_offsets"][k] - k for key, v in hdr.items() if key != "__metadata__" for k in (0, 1)})
            half = max(data_samples // 2, 1)
            edges = [ends[len(ends) * j // half] for j in range(half)] if ends else []
            spread = [n + (len(raw) - n - 1) * j // max(data_samples - half - 1, 1) for j in range(data_samples - half)]
            add(name, sorted({p for p in edges + spread if n <= p < len(raw)}), "data")
        else:
            text(name, raw, 0, "marker" if name == "COMMITTED" else "manifest")
    return out


def apply_flip(ckpt: str, flip: Flip) -> None:
    """Flip ``flip`` in place (applying it twice undoes it)."""
    with open(os.path.join(ckpt, flip.file), "r+b") as f:
        f.seek(flip.offset)
        b = f.read(1)
        f.seek(flip.offset)
        f.write(bytes([b[0] ^ (1 << flip.bit)]))


# --- the state of a job, exactly ------------------------------------------------------------


def rng_fingerprint() -> str:
    """Every generator this process restores (torch CPU, Python, NumPy), as one digest."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    doc = [base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(), random.getstate(),
           [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]]
    return digest(json.dumps(doc).encode())


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, whole and on CPU (gathers DTensors: collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model, opt = state["model"], state["optimizer"]
    o = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=o).items()}
    for p, st in get_optimizer_state_dict(model, opt, options=o)["state"].items():
        for k, v in st.items():
            out[f"optimizer/{p}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def fingerprint(state: dict) -> dict[str, Any]:
    """What a resume depends on: every tensor's bytes, the loader, extra and every RNG."""
    def raw(t: torch.Tensor) -> str:
        t = t.contiguous()
        return f"{t.dtype}{list(t.shape)}:" + digest(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return {
        "tensors": {k: raw(v) for k, v in sorted(tensors_of(state).items())},
        "loader": state["loader"].pos,
        "extra": json.dumps(state["extra"], sort_keys=True),
        "rng": rng_fingerprint(),
    }


def scramble(state: dict, seed: int) -> None:
    """Put ``state`` somewhere no checkpoint is: every tensor filled, loader and RNG moved."""
    with torch.no_grad():
        for t in state["model"].parameters():
            (t.to_local() if hasattr(t, "to_local") else t).fill_(-7.0)
        for st in state["optimizer"].state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    (v.to_local() if hasattr(v, "to_local") else v).fill_(-7)
    state["loader"].pos = -1
    state["extra"].clear()  # a load merges into the caller's dict: a fresh job's is empty
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)


def judge(outcome: Callable[[], int | None], state: dict, expected: dict[int, dict], *, before: dict | None) -> str:
    """Run ``outcome`` (a load returning the step it restored) and judge it against the
    fingerprints ``expected`` by step. ``before``: the state's fingerprint before the load,
    which a refused load must leave exactly as it was."""
    try:
        step = outcome()
    except CkptError as e:
        if e.exit_code != 1:
            return f"BAD:exit{e.exit_code}:{type(e).__name__}: {e}"
        if before is not None and fingerprint(state) != before:
            return f"BAD:half-applied:{type(e).__name__}: {e}"
        return "refused"
    except Exception as e:  # noqa: BLE001 - the sweep's boundary: anything untyped is a finding
        return f"BAD:untyped:{type(e).__name__}: {e}"
    if step not in expected:
        return f"BAD:step {step}"
    got = fingerprint(state)
    if got != expected[step]:
        diff = [k for k in ("loader", "extra", "rng") if got[k] != expected[step][k]]
        diff += [k for k in expected[step]["tensors"] if got["tensors"].get(k) != expected[step]["tensors"][k]]
        return f"BAD:silent-wrong-data:step {step}: {diff[:4]}"
    return "new" if step == max(expected) else "old"


def tally(results: list[tuple[Flip, str]]) -> dict[str, Any]:
    """Counts by region and outcome, and the first few bad cases."""
    counts: dict[str, dict[str, int]] = {}
    bad = []
    for f, out in results:
        kind = out.split(":", 2)[0] + (":" + out.split(":", 2)[1] if out.startswith("BAD") else "")
        counts.setdefault(f.region, {}).setdefault(kind, 0)
        counts[f.region][kind] += 1
        if out.startswith("BAD") and len(bad) < 12:
            bad.append(f"{f.file}@{f.offset} bit {f.bit} ({f.region}): {out}")
    return {"tried": len(results), "counts": counts, "bad": bad}


# --- the jobs ---------------------------------------------------------------------------------


def job_state(mode: str, world_size: int, seed: int = 0) -> dict:
    """A small training job's state: model, AdamW, a loader position, extra."""
    from dist_workers import build

    model, opt = build(mode, world_size, seed=seed)
    return {"model": model, "optimizer": opt, "loader": Loader(), "extra": {}}


def save_two_steps(ck: Any, state: dict, mode: str, rank: int, world_size: int) -> dict[int, dict]:
    """Train and save steps 1 and 2 (each rank's loader, extra and RNG its own); returns the
    fingerprint of what each step saved on this rank."""
    from dist_workers import train_step

    fps = {}
    for s in (1, 2):
        train_step(state["model"], state["optimizer"], s, rank, world_size, mode)
        state["loader"].pos = 10 * s + rank
        state["extra"].clear()
        state["extra"].update({"step": s, "rank": rank})
        torch.manual_seed(100 + s + 1000 * rank), random.seed(100 + s + 1000 * rank), np.random.seed(100 + s + 1000 * rank)
        fps[s] = fingerprint(state)
        ck.save(s, state).wait()
    return fps


def content(ckpt: str, *, ranks: bool = True) -> dict[str, Any]:
    """A ckptctl checkpoint's content as read back (verified): step, saved state tree, every
    tensor's bytes and, with ``ranks``, every rank's header state."""
    from ckptctl.load.reader import CheckpointReader
    from ckptctl.storage import open_storage

    with CheckpointReader(open_storage(ckpt)) as r:
        out = {
            "step": r.manifest.step,
            "state": json.dumps(r.manifest.state, sort_keys=True),
            "tensors": {n: digest(r.read(n).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for n in sorted(r.manifest.tensors)},
        }
        if ranks:
            out["ranks"] = json.dumps({str(k): v for k, v in r.rank_states().items()}, sort_keys=True)
    return out


def judge_output(run: Callable[[], Any], check: Callable[[Any], str | None]) -> str:
    """Run a verb (``run``); a success is judged by ``check(result)`` (None: the output is
    exactly right, else what is wrong); a refusal must be a typed error of exit code 1."""
    try:
        result = run()
    except CkptError as e:
        return "refused" if e.exit_code == 1 else f"BAD:exit{e.exit_code}:{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the sweep's boundary: anything untyped is a finding
        return f"BAD:untyped:{type(e).__name__}: {e}"
    try:
        wrong = check(result)
    except CkptError as e:  # the verb said yes, its output is not readable
        return f"BAD:bad-output:{type(e).__name__}: {e}"
    return "ok" if wrong is None else f"BAD:silent-wrong-data:{wrong}"
