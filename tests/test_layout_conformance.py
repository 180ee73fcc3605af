"""The layout conformance suite: what every registered layout must do, on a local root and on S3.

Parametrised over ``catalog.LAYOUTS``, which is every layout ckptctl knows: the built-in ones
and each one a distribution registers by entry point (``ckptctl.layouts``; the toy of
``tests/plugins/ckptctl-toy-layout`` is installed by scripts/setup.sh). Each layout brings a
*fixture*: how to build one of its checkpoints (complete, or as its own save leaves it when
killed) and which file is its commit record. The built-in ones are in ``BUILTIN_FIXTURES``
below; a plugin ships its own as ``build_checkpoint`` and ``commit_sidecar`` in the module of its
layout class. A layout without a fixture fails here, naming what to add.

The contract, for each layout and backend (moto over HTTP for S3; the real verbs throughout):

- a complete checkpoint is listed committed; an interrupted one is listed partial;
- deletion un-commits first: a prune whose storage fails after its first delete inside a
  checkpoint leaves that checkpoint not committed;
- a copy writes the commit record last: replaying a ``sync``'s writes one at a time, nothing
  ever reads as committed before all its files are there, byte for byte;
- a hostile commit record (zeros one byte past the 64 MiB bound JSON records are read under, or
  JSON nested 200,000 deep) makes ``verify`` of that checkpoint exit 1 naming it (never 3), and
  ``ls`` of the root still succeeds;
- every verb works through the protocol alone (ls, du, verify at every level, latest, seal,
  prune, rm: on a local root for every layout, on S3 too for the plugins');
- one checkpoint, one verdict: whatever one file of the newest checkpoint suffers, ``verify``
  at prune's level and ``prune`` agree on every checkpoint (a property, over every fixture).

Each sequence of builds is made once per module and copied into each test's root (``built``).

Deletes and writes are observed through ``Recorder``, a ``Storage`` that wraps the real backend
and forwards every call: nothing of ckptctl's is replaced.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import posixpath
import shutil
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Sequence

import boto3
import pytest

from ckptctl.errors import StorageError
from ckptctl.format.layout import MARKER
from ckptctl.format.seal import SEAL
from ckptctl.layouts import catalog, safe_load
from ckptctl.ops.retention.prune import prune
from ckptctl.ops.retention.policies import KeepLast, RetentionPolicy
from ckptctl.ops.transfer.sync import sync
from ckptctl.storage import open_storage
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer
from helpers import cli, make_checkpoints

# --- each layout's fixture ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fixture:
    build: Callable[..., str]  # (root, step, *, complete=True) -> the checkpoint's path
    sidecar: Callable[[str, int], str]  # (root, step) -> the file its commit rule reads


def _native(root: str, step: int, *, complete: bool = True) -> str:
    (path,) = make_checkpoints(root, [step], size=64, tensors=2)
    if not complete:
        os.unlink(os.path.join(path, MARKER))  # killed before the marker
    return path


def _dcp(root: str, step: int, *, complete: bool = True) -> str:
    from test_layouts import dcp_step

    return dcp_step(root, step, complete=complete)


def _hf(root: str, step: int, *, complete: bool = True) -> str:
    from test_layouts import hf_checkpoint

    return hf_checkpoint(root, step, state=complete)


def _megatron(root: str, step: int, *, complete: bool = True) -> str:
    # As test_layouts.megatron_iter (the legacy layout, the tracker written last), with the
    # optimizer state a resumable save holds: prune anchors only on a resumable checkpoint.
    import argparse

    import torch

    path = os.path.join(root, f"iter_{step:07d}", "mp_rank_00")
    os.makedirs(path)
    torch.save({"args": argparse.Namespace(hidden_size=8), "iteration": step, "checkpoint_version": 3.0,
                "model": {"w": torch.ones(4)}, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]}},
               os.path.join(path, "model_optim_rng.pt"))
    if complete:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(step))
    return os.path.dirname(path)


def _deepspeed(root: str, step: int, *, complete: bool = True) -> str:
    from test_layouts import deepspeed_tag

    return deepspeed_tag(root, step, latest=complete)


def _lightning(root: str, step: int, *, complete: bool = True) -> str:
    from test_protection import _lightning_file

    path = _lightning_file(root, step, callbacks={})  # no best checkpoint: prune may delete any old one
    if not complete:  # _atomic_save's move across filesystems killed mid-copy
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return path


def _accelerate(root: str, step: int, *, complete: bool = True) -> str:
    # A directory of a real save_state run (test_accelerate: three saves in a subprocess, made
    # once per module), renamed checkpoint_STEP; killed: save_state died after model.safetensors.
    from test_accelerate import kill_after_model

    saves = _accelerate_saves().result()
    path = os.path.join(root, f"checkpoint_{step}")
    shutil.copytree(os.path.join(saves, f"checkpoint_{step // 10 % 3}"), path)
    if not complete:
        kill_after_model(path)
    return path


_ACCELERATE_SAVES: Future[str] | None = None


def _accelerate_saves() -> Future[str]:
    """The real save_state run, started in the background (it waits on a subprocess) the first
    time it is asked for: by the module's setup when accelerate cases are to run."""
    global _ACCELERATE_SAVES
    if _ACCELERATE_SAVES is None:
        from test_accelerate import save_state_root  # skips the case where accelerate is not installed

        pool = ThreadPoolExecutor(1)
        _ACCELERATE_SAVES = pool.submit(save_state_root, os.path.join(_templates(), "accelerate-project"))
        pool.shutdown(wait=False)  # its thread ends with the run
    return _ACCELERATE_SAVES


def _composer_name(step: int) -> str:
    return f"ep{step // 10}-ba{step}-rank0.pt"  # Composer's step is the batch count


def _composer(root: str, step: int, *, complete: bool = True) -> str:
    from test_composer_nemo import composer_save

    return composer_save(root, step // 10, step, complete=complete)


def _nemo(root: str, step: int, *, complete: bool = True) -> str:
    from test_composer_nemo import nemo_save

    return nemo_save(root, step, finished=complete)  # killed: its -unfinished marker stays


def _nemo_sidecar(root: str, step: int) -> str:
    # The commit record is the marker's absence; what commit_state (and verify) then reads is
    # DCP's weights/.metadata, written last.
    from test_composer_nemo import nemo_name

    return os.path.join(root, nemo_name(step), "weights", ".metadata")


BUILTIN_FIXTURES: dict[str, Fixture] = {
    "ckptctl": Fixture(_native, lambda root, s: os.path.join(root, f"step-{s:010d}", MARKER)),
    "dcp": Fixture(_dcp, lambda root, s: os.path.join(root, f"step-{s}", ".metadata")),
    "hf-trainer": Fixture(_hf, lambda root, s: os.path.join(root, f"checkpoint-{s}", "trainer_state.json")),
    "megatron": Fixture(_megatron, lambda root, s: os.path.join(root, "latest_checkpointed_iteration.txt")),
    "deepspeed": Fixture(_deepspeed, lambda root, s: os.path.join(root, "latest")),
    "lightning": Fixture(_lightning, lambda root, s: os.path.join(root, f"epoch=0-step={s}.ckpt")),
    "accelerate": Fixture(_accelerate, lambda root, s: os.path.join(root, f"checkpoint_{s}", "random_states_0.pkl")),
    "composer": Fixture(_composer, lambda root, s: os.path.join(root, _composer_name(s))),
    "nemo": Fixture(_nemo, _nemo_sidecar),
}

LAYOUT_NAMES = [layout.name for layout in catalog.LAYOUTS]

# --- each build sequence made once per module ---------------------------------------------------

_TEMPLATES: str | None = None  # this module's template roots (tmp_path_factory)
_BUILT: dict[tuple[str, tuple[tuple[int, bool], ...]], tuple[str, list[str]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _template_roots(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[None]:
    global _TEMPLATES, _ACCELERATE_SAVES
    _TEMPLATES = str(tmp_path_factory.mktemp("templates"))
    if importlib.util.find_spec("accelerate") is not None and \
            any("[accelerate-" in item.nodeid for item in request.session.items):
        _accelerate_saves()  # runs on the other core while the cases before accelerate's run
    yield
    if _ACCELERATE_SAVES is not None:
        _ACCELERATE_SAVES.exception()  # never leave its subprocess behind
    _TEMPLATES, _ACCELERATE_SAVES = None, None
    _BUILT.clear()


def _templates() -> str:
    assert _TEMPLATES is not None, "built outside this module's tests"
    return _TEMPLATES


def built(layout: str, root: str, steps: Sequence[tuple[int, bool]]) -> list[str]:
    """The layout's fixture run for each (step, complete) in order under the local ``root``;
    returns the checkpoints' paths. Each sequence is built once per module into a template root
    and copied from there (links as links, bytes and mtimes kept), so a test that then breaks or
    deletes something breaks only its own copy."""
    key = (layout, tuple(steps))
    if key not in _BUILT:
        template = tempfile.mkdtemp(prefix=f"{layout}-", dir=_templates())
        fix = fixture_of(layout)
        made = [os.path.relpath(fix.build(template, step, complete=complete), template) for step, complete in steps]
        _BUILT[key] = (template, made)
    template, made = _BUILT[key]
    shutil.copytree(template, root, symlinks=True, dirs_exist_ok=True)
    return [os.path.join(root, rel) for rel in made]


def fixture_of(name: str) -> Fixture:
    if name in BUILTIN_FIXTURES:
        return BUILTIN_FIXTURES[name]
    layout = next(layout for layout in catalog.LAYOUTS if layout.name == name)
    module = sys.modules[layout.__class__.__module__]  # a plugin layout is held as a guest (layouts.guest)
    build, sidecar = getattr(module, "build_checkpoint", None), getattr(module, "commit_sidecar", None)
    if build is None or sidecar is None:
        pytest.fail(f"layout {name!r} has no conformance fixture: give {module.__name__} the functions "
                    "build_checkpoint(root, step, *, complete=True) and commit_sidecar(root, step) "
                    "(built-in layouts: add it to BUILTIN_FIXTURES in tests/test_layout_conformance.py)")
    return Fixture(build, sidecar)


def test_the_toy_plugin_is_registered_after_the_built_in_layouts() -> None:
    # The suite below must cover a layout added by entry point, not only the built-in ones.
    assert LAYOUT_NAMES[: len(catalog.BUILTIN)] == [layout.name for layout in catalog.BUILTIN]
    assert "toy" in LAYOUT_NAMES[len(catalog.BUILTIN):], \
        "the toy layout plugin is not installed: bash scripts/setup.sh (pip install -e tests/plugins/ckptctl-toy-layout)"


# --- a root on either backend -------------------------------------------------------------------


@dataclass
class Root:
    """A checkpoint root on one backend, built locally by a fixture and then, on S3, uploaded
    byte for byte (as a lab's upload of a local root leaves it). A symbolic link goes up as
    Composer's uploader puts its ``latest`` link: an object ``NAME.symlink`` holding the
    target's key (no other fixture makes links)."""

    local: str  # where fixtures build
    url: str  # the root as the verbs see it
    client: Any = None  # boto3, on S3

    def publish(self) -> None:
        if self.client is None:
            return
        bucket, _, prefix = self.url[len("s3://"):].partition("/")
        for dirpath, _dirs, files in os.walk(self.local):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                if rel.startswith(".ckptctl-"):  # ckptctl's own root bookkeeping stays behind
                    continue
                if os.path.islink(path):
                    target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), os.readlink(path)))
                    self.client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}.symlink",
                                           Body=f"{prefix}/{target}".encode())
                else:
                    self.client.upload_file(path, bucket, f"{prefix}/{rel}")

    def url_of(self, path: str) -> str:
        return self.url.rstrip("/") + "/" + os.path.relpath(path, self.local).replace(os.sep, "/")


def _root(backend: str, tmp_path: Any, request: pytest.FixtureRequest, name: str = "root") -> Root:
    local = str(tmp_path / name)
    os.makedirs(local)
    if backend == "local":
        return Root(local, local)
    url = request.getfixturevalue("s3_url") + "/" + name
    return Root(local, url, boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server")))


CASES = [pytest.param(name, backend, id=f"{name}-{backend}") for name in LAYOUT_NAMES for backend in ("local", "s3")]


def _statuses(url: str) -> dict[int, tuple[str, str]]:
    return {e.step: (e.layout, e.status) for e in catalog.list_checkpoints(open_storage(url))}


# --- a complete checkpoint is found, an interrupted one is not --------------------------------------


@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_complete_is_committed_and_interrupted_is_partial(layout: str, backend: str, tmp_path, request) -> None:
    root = _root(backend, tmp_path, request)
    built(layout, root.local, [(10, True), (20, True), (30, False)])
    root.publish()
    assert _statuses(root.url) == {10: (layout, "committed"), 20: (layout, "committed"), 30: (layout, "partial")}
    listed = cli("ls", root.url, "--json")
    assert listed.exit_code == 0, listed.stdout + listed.stderr


# --- storage seen from the outside ----------------------------------------------------------


class Recorder(Storage):
    """The real storage, every call forwarded; writes and deletes are appended to ``log`` as
    (action, root-relative key, bytes). ``fail_deletes_in``: names of checkpoints under the
    root; after the first delete inside one, every further delete inside one raises
    StorageError, as a connection lost mid-prune would."""

    def __init__(self, inner: Storage, log: list[tuple[str, str, bytes]] | None = None, prefix: str = "",
                 fail_deletes_in: Collection[str] = ()) -> None:
        self.inner, self.log, self.prefix, self.fail_deletes_in = inner, [] if log is None else log, prefix, fail_deletes_in
        self.url = inner.url

    def _key(self, key: str) -> str:
        return self.prefix + key

    def sub(self, key: str) -> Storage:
        return Recorder(self.inner.sub(key), self.log, self._key(key) + "/", self.fail_deletes_in)

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.children(prefix)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def open_reader(self, key: str) -> Reader:
        return self.inner.open_reader(key)

    def open_root_reader(self) -> Reader:
        return self.inner.open_root_reader()

    def open_writer(self, key: str) -> Writer:
        return _RecordingWriter(self.inner.open_writer(key), self, key)

    def write_atomic(self, key: str, data: bytes) -> None:
        self.inner.write_atomic(key, data)
        self.log.append(("write", self._key(key), bytes(data)))

    def write_if_absent(self, key: str, data: bytes) -> bool:
        done = self.inner.write_if_absent(key, data)
        if done:
            self.log.append(("write", self._key(key), bytes(data)))
        return done

    def delete(self, key: str) -> bool:
        full = self._key(key)
        inside = full.split("/", 1)[0] in self.fail_deletes_in
        if inside and any(a == "delete" and k.split("/", 1)[0] in self.fail_deletes_in for a, k, _ in self.log):
            raise StorageError(f"{self.url_of(key)}: connection lost (simulated)", hint="try again")
        gone = self.inner.delete(key)
        self.log.append(("delete", full, b""))
        return gone

    def remove_dir(self, prefix: str) -> None:
        self.inner.remove_dir(prefix)

    def abort_stale_uploads(self, prefix: str = "", **kwargs: Any) -> list[str]:
        return self.inner.abort_stale_uploads(prefix, **kwargs)

    def local_path(self, key: str = "") -> str | None:
        return self.inner.local_path(key)

    def url_of(self, key: str = "") -> str:
        return self.inner.url_of(key)


class _RecordingWriter(Writer):
    def __init__(self, inner: Writer, owner: Recorder, key: str) -> None:
        self.inner, self.owner, self.key, self.data = inner, owner, key, bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.inner.write(data)
        self.data += memoryview(data).cast("B")

    def commit(self) -> None:
        self.inner.commit()
        self.owner.log.append(("write", self.owner._key(self.key), bytes(self.data)))

    def publish(self, fallbacks: Sequence[str] = ()) -> int | None:
        taken = self.inner.publish(fallbacks)
        if taken is not None:
            name = self.key if taken == 0 else self.key.rsplit("/", 1)[0] + "/" + fallbacks[taken - 1] \
                if "/" in self.key else fallbacks[taken - 1]
            self.owner.log.append(("write", self.owner._key(name), bytes(self.data)))
        return taken

    def abort(self) -> None:
        self.inner.abort()


# --- deletion un-commits first -------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_a_prune_cut_after_its_first_delete_leaves_that_checkpoint_uncommitted(layout: str, backend: str,
                                                                               tmp_path, request) -> None:
    root = _root(backend, tmp_path, request)
    built(layout, root.local, [(10, True), (20, True)])  # prune keeps 20 and deletes 10
    root.publish()
    names = {e.name for e in catalog.list_checkpoints(open_storage(root.url))}
    recorder = Recorder(open_storage(root.url), fail_deletes_in=names)
    try:
        prune(recorder, RetentionPolicy((KeepLast(1),)))
    except StorageError:
        pass  # the simulated connection loss, raised or reported per checkpoint: either is fine here
    deletes = [key for action, key, _ in recorder.log if action == "delete" and key.split("/", 1)[0] in names]
    assert len(deletes) == 1, f"expected prune to delete old checkpoints of {layout}, got {recorder.log}"
    hit = deletes[0].split("/", 1)[0]
    entries = {e.name: e for e in catalog.list_checkpoints(open_storage(root.url))}
    assert hit not in entries or entries[hit].status != "committed", \
        f"{hit} still reads as committed after prune's first delete ({deletes[0]}): the commit file must go first"


# --- a copy writes the commit record last -------------------------------------------------------------


@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_a_sync_cut_after_any_write_leaves_nothing_committed_that_is_incomplete(layout: str, backend: str,
                                                                               tmp_path, request) -> None:
    src = str(tmp_path / "src")
    os.makedirs(src)
    built(layout, src, [(10, True), (20, True)])
    dst = _root(backend, tmp_path, request, "dst")
    recorder = Recorder(open_storage(dst.url))
    sync(open_storage(src), recorder)
    # The final state as the writes made it, checked against the destination itself: the
    # recorder saw every write (nothing bypassed the Storage interface).
    final: dict[str, bytes] = {}
    for action, key, data in recorder.log:
        if action == "write":
            final[key] = data
        else:
            final.pop(key, None)
    real = {info.key: info.size for info in open_storage(dst.url).list() if not info.key.startswith(".ckptctl-")}
    assert real == {k: len(v) for k, v in final.items() if not k.startswith(".ckptctl-")}
    copied = {e.step: e.status for e in catalog.list_checkpoints(open_storage(dst.url))}
    assert copied == {10: "committed", 20: "committed"}, f"sync did not copy the {layout} checkpoints: {copied}"
    # Replayed one write at a time into a scratch root: whatever reads as committed at any
    # point already holds every file it finally holds (the seal, ckptctl's sidecar, aside).
    scratch = str(tmp_path / "replay")
    os.makedirs(scratch)
    for i, (action, key, data) in enumerate(recorder.log):
        path = os.path.join(scratch, *key.split("/"))
        if action == "write":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        elif os.path.exists(path):
            os.unlink(path)
        for entry in catalog.list_checkpoints(open_storage(scratch)):
            if entry.status != "committed":
                continue
            wanted = {k: v for k, v in final.items()
                      if (k == entry.name or k.startswith(entry.name + "/")) and not k.endswith(SEAL)}
            missing = sorted(k for k, v in wanted.items()
                             if not os.path.isfile(os.path.join(scratch, *k.split("/")))
                             or open(os.path.join(scratch, *k.split("/")), "rb").read() != v)
            assert not missing, (f"after write {i + 1} of {len(recorder.log)} ({key}), {entry.name} reads as "
                                 f"committed without {missing}: the commit record must be written last")


# --- a hostile commit record -----------------------------------------------------------------------

# The bound the layouts read a JSON commit record under (safe_load.json_file); a hostile file one
# byte past it is refused as too big, never read whole. (Non-JSON records are read by size, zip
# directory or pickle framing, none of which must read the whole file either.)
JSON_BOUND: int = inspect.signature(safe_load.json_file).parameters["limit"].default
HOSTILE = {
    f"sparse-{JSON_BOUND >> 20}MiB+1": None,  # a file of zeros one byte over the bound (sparse on disk)
    "nested-200k": b"[" * 200_000 + b"]" * 200_000,
}


@pytest.mark.parametrize("variant", list(HOSTILE))
@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_a_hostile_commit_record_is_a_checkpoint_problem_named(layout: str, backend: str, variant: str,
                                                               tmp_path, request) -> None:
    root = _root(backend, tmp_path, request)
    _, ckpt = built(layout, root.local, [(10, True), (20, True)])
    sidecar = fixture_of(layout).sidecar(root.local, 20)
    assert os.path.isfile(sidecar), f"{layout}'s fixture names {sidecar} as its commit record; it was not built"
    content = HOSTILE[variant]
    with open(sidecar, "wb") as f:
        if content is None:
            f.truncate(JSON_BOUND + 1)
        else:
            f.write(content)
    root.publish()
    verified = cli("verify", root.url_of(ckpt), "--json")
    assert verified.exit_code == 1, f"exit {verified.exit_code}: {verified.stdout[-2000:]}{verified.stderr[-2000:]}"
    assert os.path.basename(ckpt) in verified.stdout, verified.stdout[-2000:]
    listed = cli("ls", root.url, "--json")
    assert listed.exit_code == 0, f"ls of the root failed: {listed.stdout[-2000:]}{listed.stderr[-2000:]}"
    assert any(e["step"] == 10 for e in listed.json()["checkpoints"]), listed.stdout[-2000:]
    shutil.rmtree(root.local)  # 64 MiB apparent size: gone before the next case


# --- a directory under a file's name ---------------------------------------------------------------

# Files each stack opens as files on resume (the model, the optimizer, a rank's states, the
# context), relative to the checkpoint; each is replaced by a directory of that name.
FILE_NAMES = {
    "dcp": ["__0_0.distcp"],
    "hf-trainer": ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "config.json"],
    "megatron": ["mp_rank_00/model_optim_rng.pt"],
    "deepspeed": ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"],
    "accelerate": ["model.safetensors", "optimizer.bin", "scheduler.bin"],
    "nemo": ["weights/common.pt", "weights/metadata.json", "context/io.json", "context/model.yaml"],
}
DIR_CASES = [pytest.param(layout, rel, backend, filled, id=f"{layout}-{rel}-{backend}-{'filled' if filled else 'empty'}")
             for layout, rels in FILE_NAMES.items() for rel in rels for backend, filled in
             (("local", False), ("local", True), *((("s3", True),) if layout == "deepspeed" else ()))]


@pytest.mark.parametrize(("layout", "rel", "backend", "filled"), DIR_CASES)
def test_a_directory_under_a_file_name_is_corrupt(layout: str, rel: str, backend: str, filled: bool,
                                                  tmp_path, request) -> None:
    """``model.safetensors/`` as a directory (empty, or holding a file: on S3 only that exists)
    fails verify naming it, and latest and prune never take its checkpoint for a good one."""
    root = _root(backend, tmp_path, request)
    old, new = built(layout, root.local, [(10, True), (20, True)])
    path = os.path.join(new, rel)
    assert os.path.isfile(path), f"{layout}'s fixture has no {rel}"
    os.unlink(path)
    os.makedirs(path)
    if filled:
        with open(os.path.join(path, "x"), "wb") as f:
            f.write(b"not a checkpoint file")
    root.publish()
    r = cli("verify", root.url_of(new))
    assert r.exit_code == 1, f"exit {r.exit_code}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    assert f"{rel}: is a directory, expected a file" in r.stdout, r.stdout[-2000:]
    r = cli("latest", root.url, "--json")
    assert r.exit_code == 0 and r.json()["step"] == 10, r.stdout[-2000:] + r.stderr[-2000:]
    r = cli("prune", root.url, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]
    assert os.path.basename(old) in _names(root.url), r.stdout[-2000:]  # the newest good one stays


# --- every verb, through the protocol alone ------------------------------------------------------


def _names(url: str) -> list[str]:
    return sorted(e.name for e in catalog.list_checkpoints(open_storage(url)))


# Every layout on a local root; on S3 the plugin's (the built-in layouts' S3 verbs are
# tests/test_s3_layouts.py's: each verb there costs a round of requests to moto per file).
VERB_CASES = [pytest.param(name, "local", id=f"{name}-local") for name in LAYOUT_NAMES] + \
    [pytest.param(name, "s3", id=f"{name}-s3") for name in LAYOUT_NAMES[len(catalog.BUILTIN):]]


@pytest.mark.parametrize(("layout", "backend"), VERB_CASES)
def test_every_verb_on_its_checkpoints(layout: str, backend: str, tmp_path, request) -> None:
    """ls, du, verify at every level (one checkpoint and the root), latest, seal, prune and rm,
    as a user runs them, through the Layout protocol alone: a plugin that only implements it
    gets every verb, as the built-in layouts do."""
    root = _root(backend, tmp_path, request)
    old, new = built(layout, root.local, [(10, True), (20, True)])
    root.publish()
    newest = root.url_of(new)
    listed = cli("ls", root.url, "--json")
    assert listed.exit_code == 0 and [c["status"] for c in listed.json()["checkpoints"]] == ["committed"] * 2, \
        listed.stdout + listed.stderr
    assert cli("du", root.url, "--json").exit_code == 0
    for level in (["--quick"], [], ["--load"]):  # quick, checksums (the default), load
        r = cli("verify", newest, *level, "--json")
        assert r.exit_code == 0, f"{level}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    r = cli("verify", root.url, "--all", "--json")
    assert r.exit_code == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = cli("latest", root.url, "--json")
    assert r.exit_code == 0 and r.json()["step"] == 20, r.stdout + r.stderr
    r = cli("seal", newest, "--json")
    assert r.exit_code == 0 and r.json()["checkpoints"][0]["status"] in ("sealed", "not needed", "skipped"), r.stdout
    assert cli("verify", newest, "--load").exit_code == 0  # a seal that matches stands for the load level
    r = cli("prune", root.url, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert _names(root.url) == [os.path.basename(new)], _names(root.url)
    r = cli("rm", newest, "--yes")
    assert r.exit_code == 1 and "passes full verification" in r.stderr, r.stderr  # the anchor: refused
    r = cli("rm", newest, "--yes", "--force")
    assert r.exit_code == 0 and _names(root.url) == [], r.stdout + r.stderr


# --- one checkpoint, one verdict ----------------------------------------------------------------------


def _damaged(path: str, pick: int, how: str, where: float) -> str:
    """Damage one file of the checkpoint at ``path`` (a directory, or one file): the ``pick``-th
    of its files, by ``how``; returns what was done, for the failure message."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(path) for n in names if not n.startswith(".ckptctl-"))
    target = files[pick % len(files)]
    size = os.path.getsize(target)
    if how == "delete":
        os.unlink(target)
    elif how == "truncate":
        os.truncate(target, int(size * where))
    elif how == "zero":
        with open(target, "r+b") as f:
            f.write(bytes(size))
    elif size:
        with open(target, "r+b") as f:  # flip one byte
            f.seek(min(size - 1, int(size * where)))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return f"{how} {os.path.relpath(target, os.path.dirname(path))} at {where:.2f} of {size} bytes"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_verify_at_the_anchor_level_and_prune_never_disagree(layout: str, tmp_path_factory) -> None:
    """A property over every layout's fixture: whatever one file of the newest checkpoint
    suffers, every checkpoint prune verifies gets the verdict ``verify`` gives it at prune's
    level, and prune's anchor is the newest resumable checkpoint verify passes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ckptctl.layouts.base import kind_of_checkpoint
    from ckptctl.ops.retention.plan import ANCHOR_LEVEL, plan
    from ckptctl.ops.verify.engine import verify_entry

    # Mostly flipped bytes past the headers: the damage the cheaper levels miss, where two
    # engines (or two levels) would part.
    @settings(max_examples=10, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(pick=st.integers(0, 50), how=st.sampled_from(["flip", "flip", "flip", "truncate", "zero", "delete"]),
           where=st.floats(0.3, 0.99))
    def one_case(pick: int, how: str, where: float) -> None:
        local = tempfile.mkdtemp(dir=str(tmp_path_factory.getbasetemp()))
        _old, new = built(layout, local, [(10, True), (20, True)])
        done = _damaged(new, pick, how, where)
        root = open_storage(local)
        p = plan(root, RetentionPolicy((KeepLast(1),)), record=False)
        verdicts = {}
        for entry in catalog.list_checkpoints(root):
            if entry.status == "committed" and entry.owner is not None and entry.storage is not None and \
                    kind_of_checkpoint(entry.owner, entry.storage, entry.manifest).resumable:
                verdicts[entry.name] = verify_entry(entry, ANCHOR_LEVEL).ok
        for item in p.items:
            if item.verification is not None:
                assert item.verification["ok"] == verdicts.get(item.name), (done, item.name, item.verification)
        passing = sorted((e.step, name) for name, ok in verdicts.items()
                         for e in catalog.list_checkpoints(root) if e.name == name and ok)
        want = passing[-1][1] if passing else None
        assert (p.anchors[layout].name if layout in p.anchors else None) == want, (done, p.to_dict())
        shutil.rmtree(local)

    one_case()
