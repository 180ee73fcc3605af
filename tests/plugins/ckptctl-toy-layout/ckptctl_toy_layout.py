"""A toy checkpoint layout: what a third-party layout for ckptctl is (docs/extending.md).

    ROOT/toy-N/
        a.bin, b.bin    data, any number of *.bin files
        DONE            written last: {"step": N, "files": {"a.bin": SIZE, ...}}

A ``toy-N`` directory is a checkpoint of step N once ``DONE`` is there and agrees with the
directory's name and the files' sizes. The layout is registered by the ``ckptctl.layouts``
entry point of this package; ``build_checkpoint`` and ``commit_sidecar`` are its fixture for
ckptctl's layout conformance suite (tests/test_layout_conformance.py). It imports neither torch
nor anything slow: every ckptctl command loads the installed layouts.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ckptctl.layouts import safe_load
from ckptctl.layouts.base import Examined
from ckptctl.layouts.stack import FileKind, Resume, StackLayout
from ckptctl.storage.base import Storage

DONE = "DONE"
_DATA = re.compile(r"[A-Za-z0-9_.-]+\.bin\Z", re.ASCII)


class ToyLayout(StackLayout):
    name = "toy"  # as ls's FORMAT column and --format spell it
    title = "toy (ckptctl's test plugin)"
    pattern = re.compile(r"toy-([0-9]{1,18})\Z", re.ASCII)  # a directory's name -> its step
    own_files = re.compile(r"(DONE|[A-Za-z0-9_.-]+\.bin)\Z", re.ASCII)  # files that make it ours
    claims_empty = False  # an empty toy-N may be anybody's: never ours to delete
    commit_files = (DONE,)  # deleted first, copied last

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        if ckpt.stat(DONE) is None:
            return Examined("partial", f"no {DONE}: the toy writes it last, so this save did not finish")
        doc, problem = safe_load.json_file(ckpt, DONE)  # bounded size and nesting; never raises
        if problem is not None:
            return Examined("corrupt", f"{DONE}: {problem}")
        got = doc.get("step") if isinstance(doc, dict) else None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(got, int) or isinstance(got, bool) or not isinstance(files, dict):
            return Examined("corrupt", f"{DONE} has no integer step or no files")
        if step is not None and got != step:
            return Examined("corrupt", f"{DONE} says step {got}, the directory says {step}; they must agree")
        for name, size in files.items():
            if not _DATA.match(name):  # checked before it is used as a key: never a path
                return Examined("corrupt", f"{DONE} names {name!r}, which is no data file of this checkpoint")
            info = ckpt.stat(name)
            if info is None or info.kind != "file" or info.size != size:
                return Examined("corrupt", f"{name}: missing or not the {size} bytes {DONE} records")
        return Examined("committed")

    def kind_of(self, rel: str) -> FileKind:
        return "json" if rel == DONE else "other"  # *.bin are opaque bytes here

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"--resume {ckpt_path}", ("--resume", ckpt_path))


def open_toyfs(url: str, **kwargs: Any) -> Storage:
    """``toyfs:///PATH``: the local directory PATH (the ``ckptctl.storage`` entry point)."""
    from ckptctl.storage.local import LocalStorage

    path = url[len("toyfs://"):]
    if not path.startswith("/"):
        raise ValueError(f"{url}: toyfs URLs are toyfs:///ABSOLUTE/PATH")
    return LocalStorage(path, url=url, **kwargs)


# --- the fixture: ckptctl's layout conformance suite builds checkpoints with these ----------


def build_checkpoint(root: str, step: int, *, complete: bool = True) -> str:
    """Write ``ROOT/toy-STEP`` as the toy saves it, ``DONE`` last; ``complete=False`` is a save
    killed before ``DONE``. Returns the checkpoint's path."""
    path = os.path.join(root, f"toy-{step}")
    os.makedirs(path)
    files = {"a.bin": os.urandom(4096), "b.bin": bytes(range(256)) * 8}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    if complete:
        with open(os.path.join(path, DONE), "w") as f:
            json.dump({"step": step, "files": {n: len(d) for n, d in files.items()}}, f)
    return path


def commit_sidecar(root: str, step: int) -> str:
    """The file whose content decides whether ``toy-STEP`` is committed: what a hostile-input
    test replaces."""
    return os.path.join(root, f"toy-{step}", DONE)
