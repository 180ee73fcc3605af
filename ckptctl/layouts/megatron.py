"""Megatron-LM: ``ROOT/iter_NNNNNNN`` directories and the tracker file beside them.

    ROOT/latest_checkpointed_iteration.txt      the tracker: the newest complete iteration
    ROOT/iter_0001000/
        torch_dist:  __R_N.distcp, .metadata, metadata.json, common.pt
        legacy:      mp_rank_TT[_PPP]/model_optim_rng.pt (+ distrib_optim.pt)

Commit rule (megatron/training/checkpointing.py, ``save_checkpoint``): every rank writes its
files into ``iter_{:07d}``, the ranks meet at a barrier, and only then rank 0 writes the
iteration into ``latest_checkpointed_iteration.txt`` (``get_checkpoint_tracker_filename``);
``load_checkpoint`` (``--load ROOT``) reads the tracker and loads that iteration. So an
iteration is complete when it is at or below the tracker's and its files are there: a
torch_dist checkpoint (``megatron/core/dist_checkpointing``: DCP files with ``.metadata``, and
``metadata.json``) or legacy ``mp_rank_*/model_optim_rng.pt`` files. The tracker's target is
never deleted by prune. If the directory holds ``integrity.json`` (a JSON object mapping each
file's relative path to its SHA-256, at the top level or under ``"files"``), verify checks it.

Legacy files are test-loaded with ``torch.load(weights_only=True)`` allowing
``argparse.Namespace`` (Megatron's ``args``) and numpy's RNG state; a torch_dist checkpoint's
records are decoded as DCP's are (``dcp.load_records``: TransformerEngine's ``_extra_state``
is an ``io.BytesIO``, decoded structurally). Anything else is never unpickled, and a file or
record decoded neither way fails the load level.
Resumable or export (``kind_of_checkpoint``): ``save_checkpoint`` leaves the optimizer out with
``--no-save-optim``. A torch_dist iteration is resumable when ``.metadata`` lists an
``optimizer.*`` key (the sharded optimizer state, distributed or not), else an export; a legacy
one when ``distrib_optim.pt`` is there or ``model_optim_rng.pt`` holds ``optimizer`` (read with
``torch.load(weights_only=True)``, tensors mapped, not read), else an export.
Weakness: a legacy ``model_optim_rng.pt`` that cannot be read safely (a class beyond the
allow-list in ``args``) says nothing, and counts as resumable (verify judges it); on ``s3://``
telling a legacy iteration apart downloads that file.
Weakness: Megatron has no keep-last-N (Megatron-LM#1354), and the tracker is rewritten in
place (not atomically): an empty or garbled tracker makes every iteration read as corrupt
(never complete, never deleted as abandoned: which one it named is unknown), and so does a
missing tracker for an iteration whose files are all there.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import posixpath
import re
from typing import Iterable, Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.stack import StackLayout, finding_in, optimizer_in_file, undetermined
from ckptctl.format.manifest import Manifest
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import open_file

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY = re.compile(r"mp_rank_[0-9]{2}(_[0-9]{3})?/model_optim_rng\.pt\Z")
INTEGRITY = "integrity.json"


class MegatronLayout(StackLayout):
    name = "megatron"
    title = "Megatron-LM"
    pattern = re.compile(r"iter_([0-9]{7,19})\Z", re.ASCII)
    own_files = re.compile(r"(mp_rank_[0-9]{2}(_[0-9]{3})?|\.metadata|metadata\.json|common\.pt|.+\.distcp|"
                           r"integrity\.json)\Z")
    claims_empty = True  # made by ensure_directory_exists before any rank wrote
    pointer_file = TRACKER
    commit_files = (".metadata", "metadata.json")

    def __init__(self) -> None:
        super().__init__()
        self.tracker: int | None = None
        self.tracker_problem: str | None = f"no {TRACKER} at the root"
        self.tracker_garbled = False  # present, but not an iteration

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return (argparse.Namespace, *safe_load.numpy_rng())

    def read_root(self, root: Storage) -> None:
        text = safe_load.read_pointer(root, TRACKER, 64)
        if text is None:
            self.tracker, self.tracker_problem = None, f"no {TRACKER} at the root (Megatron writes it after every rank saved)"
            return
        if text.isdigit() and text.isascii():
            self.tracker, self.tracker_problem = int(text), None
        else:
            self.tracker, self.tracker_problem = None, f"{TRACKER} holds {text[:20]!r}, not an iteration"
            self.tracker_garbled = True

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        if self.tracker is None and self.tracker_garbled:
            # The tracker is there but unreadable (rewritten in place, cut short): which
            # iterations it covers is unknown, so none is taken for an abandoned save.
            return Examined("corrupt", f"{self.tracker_problem}; left alone, not taken for an abandoned save")
        if self.tracker is None:
            if _files_problem(ckpt) is None:
                # No tracker, yet every file is here: the tracker was lost (deleted, or the
                # iterations copied without it) as likely as the first save was cut short.
                return Examined("corrupt", f"{self.tracker_problem}, but its files are complete; left alone, "
                                           "not taken for an abandoned save (restore the tracker)")
            return Examined("partial", f"{self.tracker_problem}; no iteration is committed")
        if step is None or step > self.tracker:
            return Examined("partial", f"newer than {TRACKER} (iteration {self.tracker}): Megatron writes the tracker "
                                       "after every rank saved, so this save did not finish")
        problem = _files_problem(ckpt)
        return Examined("committed") if problem is None else Examined("corrupt", problem)

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        if ".metadata" in files:
            from ckptctl.interop.dcp_io import read_metadata  # needs torch

            try:
                md = read_metadata(ckpt)
            except InvalidCheckpoint as e:
                out.problems.append(finding_in(ckpt, ".metadata", e, e.hint))
            else:
                if level == "load":  # torch_dist is DCP-format: every record decoded as DCP's are
                    from ckptctl.layouts.dcp import load_records

                    load_records(ckpt, md, self.allowed, out)
        if INTEGRITY in files and level != "quick":
            _check_integrity(ckpt, out)

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        children = ckpt.children()
        if any(c.key == ".metadata" for c in children):  # torch_dist
            from ckptctl.layouts.dcp import optimizer_listed

            return optimizer_listed(ckpt, ".metadata", "optimizer.", "model only (--no-save-optim)")
        files = sorted(_legacy_files(ckpt, children))
        dist = next((f for f in files if f.endswith("/distrib_optim.pt")), None)
        if dist is not None:
            return CheckpointKind("resumable", f"{dist} holds the distributed optimizer's state")
        legacy = next((f for f in files if LEGACY.match(f)), None)
        if legacy is None:
            return undetermined("no model_optim_rng.pt")
        return optimizer_in_file(ckpt, legacy, self.allowed, f"{legacy} holds no optimizer: model only (--no-save-optim)")

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        if self.tracker is None and self.tracker_garbled:
            why = f"{self.tracker_problem}: the iteration it names is unknown; kept for safety"
            return {n: why for n, status in entries if status not in ("partial", "unknown")}
        if self.tracker is None:
            return {}
        return {f"iter_{self.tracker:07d}": f"{TRACKER} names it (Megatron's --load resumes from it)"}

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        return TRACKER, f"{step}".encode("ascii")  # as Megatron writes it: the iteration, no newline

    def pointer_step(self, raw: bytes) -> int | None:
        text = raw[:64].decode("ascii", "replace").strip()
        return int(text) if text.isdigit() and text.isascii() else None

    def assuming_pointer(self, name: str, step: int) -> "MegatronLayout":
        bound = copy.copy(self)
        bound.tracker, bound.tracker_problem = max(step, self.tracker or 0), None
        return bound

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        if self.tracker is None:
            return None
        return TRACKER, f"iter_{self.tracker:07d}", self.tracker  # the name Megatron's loader builds

    def resume(self, ckpt_path: str, step: int) -> Resume:
        # ``--load ROOT`` loads the tracker's iteration; ``--ckpt-step N`` overrides the tracker
        # (megatron/training/checkpointing.py, _load_base_checkpoint), so the argv always pins it:
        # a save that rewrites the tracker between `latest` and the launch changes nothing.
        root = posixpath.dirname(ckpt_path.rstrip("/"))
        how = f"--load {root}"
        exact = step == self.tracker
        if not exact:
            how += f" --ckpt-step {step} (the tracker names iteration {self.tracker}, which did not verify)"
        return Resume(root, how, ("--load", root, "--ckpt-step", str(step)), exact,
                      None if exact else f"{TRACKER} names iteration {self.tracker}")


def _files_problem(ckpt: Storage) -> str | None:
    """Why the iteration directory ``ckpt`` does not hold a whole checkpoint's files, or None."""
    children = ckpt.children()
    names = {c.key for c in children}
    if ".metadata" in names or "metadata.json" in names:
        for need in (".metadata", "metadata.json"):
            if safe_load.regular_size(ckpt, need) in (None, 0):
                return f"torch_dist checkpoint without a complete {need}"
        return None
    if any(LEGACY.match(rel) for rel in _legacy_files(ckpt, children)):
        return None
    return ("at or below the tracker's iteration but neither a torch_dist checkpoint (.metadata + metadata.json) "
            "nor mp_rank_*/model_optim_rng.pt is here")


def _legacy_files(ckpt: Storage, children: Sequence[ObjectInfo]) -> list[str]:
    """The files inside the ``mp_rank_*`` directories (never through a link), as keys."""
    out = []
    for child in children:
        if child.key.startswith("mp_rank_") and child.kind == "dir":
            out += [info.key for info in ckpt.children(child.key)]
    return out


def _check_integrity(ckpt: Storage, out: Checked) -> None:
    doc, problem = safe_load.json_file(ckpt, INTEGRITY)
    table = doc.get("files", doc) if isinstance(doc, dict) else None
    if problem is not None or not isinstance(table, dict):
        out.problems.append(Problem(problem or "not a JSON object of file -> SHA-256", file=INTEGRITY))
        return
    for rel, want in sorted(table.items()):
        if not isinstance(want, str) or ".." in rel.split("/") or rel.startswith("/"):
            out.problems.append(Problem(f"entry {rel!r} is not a relative path with a SHA-256", file=INTEGRITY))
            continue
        f = open_file(ckpt, rel)
        if f is None:
            out.problems.append(Problem(f"listed in {INTEGRITY} but missing", file=rel))
            continue
        h = hashlib.sha256()
        with f:
            while chunk := f.read(safe_load.CHUNK):
                h.update(chunk)
                out.bytes_read += len(chunk)
        if h.hexdigest() != want.lower():
            out.problems.append(Problem(f"SHA-256 differs from {INTEGRITY}: the bytes changed after the save", file=rel,
                                        hint="bit rot or an overwrite; use an older checkpoint"))
