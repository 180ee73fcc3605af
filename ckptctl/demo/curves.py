"""The demo's verdict: each job's loss log (one JSON line per step, the float64's exact bits
beside the value for people), and every step's loss compared with the uninterrupted
reference's, bit for bit.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

REFERENCE, KILLED, RESUMED = "reference", "killed job", "resumed job"


def write_loss(f: Any, step: int, loss: float) -> None:
    """One log line per step; ``bits`` is the exact float64, ``loss`` is for people."""
    f.write(json.dumps({"step": step, "loss": loss, "bits": struct.pack(">d", loss).hex()}) + "\n")
    f.flush()


def bits(x: float) -> bytes:
    """The float64's raw bytes: equal bits, not ``==`` (which calls 0.0 and -0.0 equal and a
    NaN unequal to itself)."""
    return struct.pack(">d", x)


def full(x: float) -> str:
    """A value in full precision: shortest round-trip repr, and its exact hex form."""
    return f"{x!r} ({x.hex()}, bits {bits(x).hex()})"


@dataclass(frozen=True)
class Mismatch:
    """The first step at which a run's loss is not the reference's, bit for bit."""

    step: int
    run: str
    expected: float | None  # None: the reference has no such step
    got: float | None  # None: the run has no such step

    def __str__(self) -> str:
        if self.got is None:
            return f"step {self.step}: no loss from the {self.run} (reference {full(self.expected)})"  # type: ignore[arg-type]
        if self.expected is None:
            return f"step {self.step}: the reference has no loss, the {self.run} has {full(self.got)}"
        return f"step {self.step}: {self.run} {full(self.got)} != reference {full(self.expected)}"


def compare_curves(reference: Mapping[int, float], runs: Sequence[tuple[str, Mapping[int, float]]], steps: int) -> Mismatch | None:
    """None when every step 1..``steps`` has a loss from some run, and every loss any run
    logged equals the reference's bit for bit; else the mismatch at the lowest step (first in
    ``runs`` order on a tie)."""
    found: list[Mismatch] = []
    for step in range(1, steps + 1):
        if not any(step in curve for _, curve in runs):
            found.append(Mismatch(step, " or ".join(name for name, _ in runs), reference.get(step), None))
    for name, curve in runs:
        for step, got in curve.items():
            expected = reference.get(step)
            if expected is None or bits(got) != bits(expected):
                found.append(Mismatch(step, name, expected, got))
    if not found:
        return None
    order = {name: i for i, (name, _) in enumerate(runs)}
    return min(found, key=lambda m: (m.step, order.get(m.run, -1)))


def read_curve(path: str) -> dict[int, float]:
    """Step -> loss from a job's log. A last line without its newline (the job was killed
    while writing it) is not a loss."""
    curve: dict[int, float] = {}
    if not os.path.exists(path):
        return curve
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            rec = json.loads(line)
            curve[int(rec["step"])] = struct.unpack(">d", bytes.fromhex(rec["bits"]))[0]
    return curve


def stitch(killed: Mapping[int, float], resumed: Mapping[int, float]) -> tuple[int, list[tuple[str, dict[int, float]]]]:
    """The step the resumed job started after, and the curve to judge: the killed job's steps
    up to that step, the resumed job's from there on. The killed job's steps after it (trained,
    then lost with the kill) are judged too: the same computation must give the same bits."""
    start = min(resumed) - 1 if resumed else max(killed, default=0)
    return start, [(KILLED, dict(killed)), (RESUMED, dict(resumed))]


def judge(log_of: Mapping[str, str], steps: int, kill_at: int) -> list[str]:
    """Step 5 from the three jobs' logs: what was compared, then the one-line verdict (last)."""
    reference = read_curve(log_of[REFERENCE])
    start, runs = stitch(read_curve(log_of[KILLED]), read_curve(log_of[RESUMED]))
    last_killed = max(runs[0][1], default=0)
    lines = [f"5. compare every loss with the reference's, bit for bit (float64): the killed job's steps 1-{last_killed}"
             f" (it resumed from {start}), the resumed job's steps {start + 1}-{steps}"]
    mismatch = compare_curves(reference, runs, steps)
    if mismatch is not None:
        lines.append(f"   logs: {os.path.dirname(log_of[REFERENCE])}")
        lines.append(f"verdict: FAIL: the interrupted run is not the uninterrupted one; first difference at {mismatch}")
    else:
        lines.append(f"verdict: PASS: killed mid-save at step {kill_at}, resumed from step {start}; all {steps} losses equal "
                     f"the uninterrupted run's bit for bit (final loss {reference[steps]!r})")
    return lines
