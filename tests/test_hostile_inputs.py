"""Hostile files never crash or hang ckptctl (issue 11 §3): every parser of a file the tool reads
gives a typed value or ``InvalidCheckpoint``, and the root-wide verbs skip a checkpoint whose
manifest or marker is hostile, exit 0 or 1 (never 3, never a traceback) and still find the older
good checkpoint.

Property-based: each parser is fed thousands of generated documents (valid ones mutated at a
random place with wrong types, NaN/Infinity/1e308, huge integers and shapes, lone surrogates,
nesting ≥ 1,000 levels; truncated and random bytes). Each property runs twice: once
derandomized (the same examples every run, for CI) and once with a random seed, which is noted
in the failure report; set ``CKPTCTL_HOSTILE_SEED`` to replay it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import time
from typing import Any, Callable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format import parse
from ckptctl.format.checksum import digest
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
from ckptctl.format.marker import MAX_MARKER_BYTES, Marker
from ckptctl.format.shard import Chunk, build_header, parse_header
from ckptctl.interop.safetensors_io import SafetensorsSource
from ckptctl.layouts.native import NativeLayout
from ckptctl.ops.lock import LockInfo, stale_reason
from ckptctl.ops.verify.cache import CACHE_KEY, VerifyCache, verify_cached
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints

SEED = int(os.environ.get("CKPTCTL_HOSTILE_SEED") or random.randrange(2**32))
_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
FUZZ_DOCS = 1200  # per parser and seed, from a plain seeded generator (cheap: no shrinking)
PROPERTY_EXAMPLES = 100  # per parser, through hypothesis (shrinks a failure to a small example)


def at(path):
    """(storage, key) of a local file, as the layouts' readers take it."""
    import os

    from ckptctl.storage import open_storage

    path = str(path)
    return open_storage(os.path.dirname(os.path.abspath(path))), os.path.basename(path)


# --- hostile documents: one generator, driven by hypothesis or by a seeded Random -----------

class RandomPick:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.rng.randrange(len(seq))]


class DataPick:
    def __init__(self, data: Any) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.data.draw(st.sampled_from(seq))


def nest(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    doc = leaf
    for _ in range(depth):
        doc = [doc] if kind == "list" else {"a": doc}
    return doc


def deep_bytes(depth: int, kind: str = "list") -> bytes:
    """Nesting as text, built without recursion (json.dumps itself would recurse)."""
    return (b"[" * depth + b"1" + b"]" * depth) if kind == "list" else (b'{"a":' * depth + b"1" + b"}" * depth)


INTS = [2**63, 2**63 - 1, -(2**63), 2**64, 2**70, 10**30, 10**39, 0, -1, 1, 2**31, 2**62]
FLOATS = [1e308, -1e308, 1e300, float("nan"), float("inf"), float("-inf"), 0.5, -0.0, 5e-324]
STRINGS = ["", "../other_run/x.safetensors", "/etc/passwd", "a/b", "float32", "F32", "complex128", "ckptctl",
           "ckptctl-commit", "ckptctl-lock", "xxh3-64", "model", "\x00", "x" * 5000, "\ud800", "a\udfffb"]


def scalar(p: Any) -> Any:
    kind = p.int(0, 9)
    if kind == 0:
        return p.choice([None, True, False])
    if kind == 1:
        return p.int(-(2**70), 2**70)
    if kind == 2:
        return p.choice(INTS)
    if kind == 3:
        return p.choice(FLOATS)
    if kind == 4:  # any 64-bit pattern: subnormals, NaNs, infinities, huge and tiny
        return struct.unpack("<d", struct.pack("<Q", p.int(0, 2**64 - 1)))[0]
    if kind == 5:  # junk text, lone surrogates included
        return "".join(chr(p.int(0, 0x10FFFF)) for _ in range(p.int(0, 6)))
    if kind == 6:
        return [p.int(-5, 2**70) for _ in range(p.int(0, 5))]  # shapes, offsets
    return p.choice(STRINGS)


def value(p: Any, depth: int = 0) -> Any:
    if depth >= 3 or p.int(0, 2):
        return scalar(p)
    if p.int(0, 1):
        return [value(p, depth + 1) for _ in range(p.int(0, 3))]
    return {str(scalar(p)): value(p, depth + 1) for _ in range(p.int(0, 3))}


def hostile(p: Any) -> Any:
    if p.int(0, 15) == 0:
        return nest(p.int(900, 2500), kind=p.choice(["list", "dict"]))
    return value(p)


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value inside ``doc``, iteratively."""
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            if len(out) < 10_000:
                stack.append(v)
    return out


def mutated(p: Any, base: Any) -> Any:
    """``base`` with one to three values replaced, removed or added at random places."""
    doc = copy.deepcopy(base)
    for _ in range(p.int(1, 3)):
        slots = _slots(doc)
        if not slots or p.int(0, 30) == 0:
            return hostile(p)  # the whole document
        node, key = slots[p.int(0, len(slots) - 1)]
        action = p.choice(["replace", "replace", "replace", "delete", "add"])
        if action == "replace":
            node[key] = hostile(p)
        elif action == "delete":
            del node[key]
        elif isinstance(node, dict):
            node[str(scalar(p))] = hostile(p)
        else:
            node.append(hostile(p))
    return doc


def encode(doc: Any) -> bytes:
    try:
        text = json.dumps(doc, allow_nan=True)
    except RecursionError:  # a generated nest deeper than json.dumps can write: as text instead
        return deep_bytes(2000)
    return text.encode("utf-8", "surrogatepass")


def hostile_bytes(p: Any, base: Any) -> bytes:
    good = encode(base)
    how = p.choice(["mutate"] * 7 + ["truncate", "flip", "random", "deep"])
    if how == "mutate":
        return encode(mutated(p, base))
    if how == "truncate":
        return good[: p.int(0, len(good) - 1)]
    if how == "flip":
        i = p.int(0, len(good) - 1)
        return good[:i] + bytes([good[i] ^ p.int(1, 255)]) + good[i + 1 :]
    if how == "random":
        return bytes(p.int(0, 255) for _ in range(p.int(0, 64)))
    return deep_bytes(p.int(900, 5000), p.choice(["list", "dict"]))


def hostile_docs(make: Callable[[Any], bytes], check: Callable[[bytes], None], n: int = PROPERTY_EXAMPLES) -> tuple[Callable, Callable, Callable]:
    """Three tests of one parser: hypothesis, derandomized (CI); hypothesis from SEED; and
    FUZZ_DOCS documents from a seeded Random for each of a fixed seed and SEED. A failure
    names the seed to replay with CKPTCTL_HOSTILE_SEED."""

    def body(data: Any) -> None:
        note(f"random run seed: CKPTCTL_HOSTILE_SEED={SEED}")
        check(make(DataPick(data)))

    fixed = settings(max_examples=n, derandomize=True, **_SETTINGS)(given(st.data())(body))
    rnd = seed(SEED)(settings(max_examples=max(n // 4, 10), **_SETTINGS)(given(st.data())(body)))

    def fuzz() -> None:
        for s in (0, SEED):
            pick = RandomPick(random.Random(s))
            for i in range(FUZZ_DOCS):
                raw = make(pick)
                try:
                    check(raw)
                except Exception as e:  # re-raised, naming the seed and the document
                    raise AssertionError(f"document {i} of seed {s} (CKPTCTL_HOSTILE_SEED={s}): "
                                         f"{type(e).__name__}: {e}\n{raw[:300]!r}") from e

    return fixed, rnd, fuzz


# --- the documents, valid ------------------------------------------------------------------

SHARD = "rank-00000-of-00001.safetensors"
GOOD_MANIFEST = Manifest(
    step=7, created=1.7e9, world_size=1,
    files=[FileEntry(SHARD, 1000, "0123456789abcdef", 0, 2)],
    tensors={"model/w": TensorEntry("float32", (4, 2), "model", 1), "model/b": TensorEntry("bfloat16", (3,), "model", 1)},
    state={"model": {"w": {"__tensor__": "model/w"}}, "loss": 0.5, "betas": {"__tuple__": [0.9, 0.99]}},
    stats={"bytes": 1000.0, "stall_s": 0.1}, tool={"name": "ckptctl", "version": "1"},
)
GOOD_MANIFEST_DOC = json.loads(GOOD_MANIFEST.to_json())
GOOD_MARKER_DOC = json.loads(Marker.for_manifest(7, GOOD_MANIFEST.to_json()).to_json())
_CHUNKS = [Chunk("model/w", "float32", (4, 2), (0, 0), 0, 32, "aa" * 8), Chunk("model/b", "bfloat16", (3,), (0,), 32, 38, "bb" * 8)]
_HEADER = build_header(_CHUNKS, rank=0, rank_state={"rng": [1, 2, 3]})
GOOD_SHARD_DOC = json.loads(_HEADER[8:])
GOOD_SHARD_META = json.loads(GOOD_SHARD_DOC["__metadata__"]["ckptctl"])
GOOD_LOCK_DOC = json.loads(LockInfo("other-host", 12345, "999", 1.7e9, 1.7e9, "ckptctl prune /r", "t0ken").to_json())
GOOD_INDEX_DOC = {"metadata": {"total_size": 32}, "weight_map": {"w": "model.safetensors"}}


def only_invalid(parser: Callable[[], Any]) -> Any:
    """Run ``parser``: a value or InvalidCheckpoint are fine; anything else fails the test."""
    try:
        return parser()
    except InvalidCheckpoint as e:
        assert str(e) and "\n" not in str(e), "errors are one line"
        return None


# --- each parser, property-based -----------------------------------------------------------

def _manifest(raw: bytes) -> None:
    m = only_invalid(lambda: Manifest.from_json(raw, "m.json"))
    if m is not None:  # what is accepted is typed, in range, and round-trips
        assert isinstance(m.step, int) and not isinstance(m.step, bool) and 0 <= m.step < 2**63
        assert all(t.nbytes < 2**63 for t in m.tensors.values()) and m.total_bytes >= 0
        Manifest.from_json(m.to_json(), "again")


test_manifest_parser, test_manifest_parser_random_seed, test_manifest_parser_fuzz = hostile_docs(
    lambda p: hostile_bytes(p, GOOD_MANIFEST_DOC), _manifest)


def _marker(raw: bytes) -> None:
    mk = only_invalid(lambda: Marker.from_json(raw, "COMMITTED"))
    if mk is not None:
        assert 0 <= mk.step < 2**63 and 0 <= mk.manifest_size <= 1 << 30
        only_invalid(lambda: mk.check(b"{}", "m.json"))


test_marker_parser, test_marker_parser_random_seed, test_marker_parser_fuzz = hostile_docs(
    lambda p: hostile_bytes(p, GOOD_MARKER_DOC), _marker)


def shard_bytes(p: Any) -> bytes:
    outer, meta = copy.deepcopy(GOOD_SHARD_DOC), copy.deepcopy(GOOD_SHARD_META)
    if p.int(0, 1):
        meta = mutated(p, meta)
    else:
        outer = mutated(p, outer)
    if isinstance(outer, dict) and isinstance(outer.get("__metadata__"), dict):
        outer["__metadata__"]["ckptctl"] = encode(meta).decode("utf-8", "surrogatepass")
    raw = encode(outer) if p.int(0, 9) else deep_bytes(p.int(900, 3000))
    return struct.pack("<Q", len(raw)) + raw + bytes(p.choice([38, 0, 40]))


def _shard(raw: bytes) -> None:
    h = only_invalid(lambda: parse_header(raw, len(raw), "rank.safetensors"))
    if h is not None:
        assert h.data_size <= len(raw) and all(c.end >= c.begin for c in h.chunks)


test_shard_header_parser, test_shard_header_parser_random_seed, test_shard_header_parser_fuzz = hostile_docs(
    shard_bytes, _shard)


def _lock(raw: bytes) -> None:
    info = LockInfo.from_json(raw)  # a lock it cannot read is None: never an exception
    if info is not None:
        now = time.time()
        info.describe(now)
        stale_reason(info, now=now, stale_after_s=3600.0, host="not-" + info.host)


test_lock_parser, test_lock_parser_random_seed, test_lock_parser_fuzz = hostile_docs(
    lambda p: hostile_bytes(p, GOOD_LOCK_DOC), _lock)


@pytest.fixture(scope="module")
def good_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Steps 1 and 2, committed; tests that damage step 2 put it back afterwards."""
    root = str(tmp_path_factory.mktemp("root"))
    make_checkpoints(root, [1, 2], size=16, tensors=2)
    return root


def _saved(path: str) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in (MANIFEST, MARKER)}


def _put(path: str, files: dict[str, bytes]) -> None:
    for n, raw in files.items():
        with open(os.path.join(path, n), "wb") as f:
            f.write(raw)


def test_verification_record_parser(good_root: str) -> None:
    """Hostile ``.ckptctl-verified.json`` (mutations of a real record whose fingerprint would
    otherwise hit): the record is ignored or used, verification still runs, nothing raises."""
    root = open_storage(good_root)
    name = os.path.basename(ckpt_dir(good_root, 1))
    cache = VerifyCache.load(root)
    verify_cached(root.sub(name), name, cache, layout=NativeLayout(), level="quick")
    cache.save()
    base = json.loads(open(os.path.join(good_root, CACHE_KEY), "rb").read())
    try:
        @settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, **_SETTINGS)
        @given(st.data())
        def prop(data: Any) -> None:
            raw = hostile_bytes(DataPick(data), base)
            with open(os.path.join(good_root, CACHE_KEY), "wb") as f:
                f.write(raw)
            loaded = VerifyCache.load(root)
            report, _, _ = verify_cached(root.sub(name), name, loaded, layout=NativeLayout(), level="quick")
            assert report.ok

        prop()
    finally:
        os.unlink(os.path.join(good_root, CACHE_KEY))


def test_hf_index_parser(tmp_path: Any) -> None:
    """Hostile ``model.safetensors.index.json``: the source opens or refuses with
    InvalidCheckpoint (a missing file named by it: UsageError/InvalidCheckpoint), nothing else."""
    from ckptctl.interop.safetensors_io import build_header as st_header
    from ckptctl.interop.base import TensorMeta

    header, _ = st_header([TensorMeta("w", "float32", (8,))], {})
    (tmp_path / "model.safetensors").write_bytes(header + bytes(32))

    @settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, **_SETTINGS)
    @given(st.data())
    def prop(data: Any) -> None:
        raw = hostile_bytes(DataPick(data), GOOD_INDEX_DOC)
        (tmp_path / "model.safetensors.index.json").write_bytes(raw)
        try:
            SafetensorsSource(str(tmp_path)).close()
        except (InvalidCheckpoint, UsageError) as e:
            assert str(e) and "\n" not in str(e)

    prop()


# --- deep nesting, explicitly, for every file type -----------------------------------------

DEPTHS = [129, 999, 1000, 5000, 100_000]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deep_nesting_is_invalid_for_every_file_type(tmp_path: Any, depth: int, kind: str) -> None:
    deep = deep_bytes(depth, kind)
    # the whole document, and the same nesting inside an otherwise valid one
    in_manifest = GOOD_MANIFEST.to_json().replace(b'"loss": 0.5', b'"loss": ' + deep)
    for raw in (deep, in_manifest):
        with pytest.raises(InvalidCheckpoint, match="nested"):
            Manifest.from_json(raw, "m.json")
    in_marker = json.dumps(GOOD_MARKER_DOC).encode().replace(b'"committed"', b'"x": ' + deep + b', "committed"')
    for raw in (deep, in_marker):
        with pytest.raises(InvalidCheckpoint, match="nested"):
            Marker.from_json(raw, "COMMITTED")
    meta = json.dumps(GOOD_SHARD_META).replace('"rank_state": {', '"rank_state": {"deep": ' + deep.decode() + ", ")
    for outer in (deep, json.dumps({**GOOD_SHARD_DOC, "__metadata__": {"ckptctl": meta}}).encode()):
        raw = struct.pack("<Q", len(outer)) + outer + bytes(38)
        with pytest.raises(InvalidCheckpoint, match="nested"):
            parse_header(raw, len(raw), "rank.safetensors")
    assert LockInfo.from_json(deep) is None
    lock = json.dumps(GOOD_LOCK_DOC).encode().replace(b'"host"', b'"x": ' + deep + b', "host"')
    assert LockInfo.from_json(lock) is None
    root = open_storage(str(tmp_path))
    (tmp_path / CACHE_KEY).write_bytes(deep)
    assert VerifyCache.load(root).notes and "nested" in VerifyCache.load(root).notes[0]
    (tmp_path / "model.safetensors.index.json").write_bytes(deep)
    with pytest.raises(InvalidCheckpoint, match="nested"):
        SafetensorsSource(str(tmp_path))


def test_bounds_named_in_the_issue() -> None:
    """Each reproduction of issue 11 §3, refused with InvalidCheckpoint naming the field."""

    def manifest(change: Callable[[dict[str, Any]], None]) -> bytes:
        d = copy.deepcopy(GOOD_MANIFEST_DOC)
        change(d)
        return json.dumps(d, allow_nan=True).encode()

    w = lambda d: d["tensors"]["model/w"]  # noqa: E731
    cases = [
        ("dtype", lambda d: w(d).update(dtype=["float32"])),
        ("dtype", lambda d: w(d).update(dtype="complex128")),
        ("created", lambda d: d.update(created=float("nan"))),
        ("created", lambda d: d.update(created=float("-inf"))),
        ("created", lambda d: d.update(created=1e300)),
        ("int64", lambda d: w(d).update(shape=[2**62, 2**62])),
        ("shape", lambda d: w(d).update(shape=[-1, 2])),
        ("shape", lambda d: w(d).update(shape=[True])),
        ("stall_s", lambda d: d["stats"].update(stall_s=1e308)),
        ("stall_s", lambda d: d["stats"].update(stall_s=float("inf"))),
        ("step", lambda d: d.update(step=True)),
        ("step", lambda d: d.update(step=-5)),
        ("step", lambda d: d.update(step=10**30)),
        ("step", lambda d: d.update(step=2**63)),
        ("size", lambda d: d["files"][0].update(size=-1)),
    ]
    for field, change in cases:
        with pytest.raises(InvalidCheckpoint, match=field):
            Manifest.from_json(manifest(change), "m.json")
    assert LockInfo.from_json(json.dumps(dict(GOOD_LOCK_DOC, pid=2**63)).encode()) is None
    assert LockInfo.from_json(json.dumps(dict(GOOD_LOCK_DOC, started=float("nan")), allow_nan=True).encode()) is None
    for size in (-1, float("inf"), 1e300, 2**63, True):
        mk = dict(GOOD_MARKER_DOC, manifest=dict(GOOD_MARKER_DOC["manifest"], size=size))
        with pytest.raises(InvalidCheckpoint, match="size|non-finite"):
            Marker.from_json(json.dumps(mk, allow_nan=True).encode(), "COMMITTED")
    with pytest.raises(InvalidCheckpoint, match="bytes"):
        Marker.from_json(json.dumps(GOOD_MARKER_DOC).encode() + b" " * MAX_MARKER_BYTES, "COMMITTED")


def test_forward_compatibility() -> None:
    """Unknown fields are ignored everywhere; a higher major version is refused saying to
    upgrade; a version that is not a positive integer is garbage."""
    d = copy.deepcopy(GOOD_MANIFEST_DOC)
    d["future"] = {"x": 1}
    d["files"][0]["future_per_file"] = "x"
    d["tensors"]["model/w"]["layout"] = "strided"
    assert Manifest.from_json(json.dumps(d).encode(), "m.json").files[0].name == SHARD
    mk = dict(GOOD_MARKER_DOC, future=1, manifest=dict(GOOD_MARKER_DOC["manifest"], extra=2))
    assert Marker.from_json(json.dumps(mk).encode(), "COMMITTED").step == 7
    meta = dict(GOOD_SHARD_META, future=[1])
    outer = json.dumps({**GOOD_SHARD_DOC, "__metadata__": {"ckptctl": json.dumps(meta)}}).encode()
    assert len(parse_header(struct.pack("<Q", len(outer)) + outer + bytes(38), len(outer) + 46, "s").chunks) == 2

    newer = "written by a newer ckptctl \\(format v2\\); upgrade"
    with pytest.raises(InvalidCheckpoint, match=newer):
        Manifest.from_json(json.dumps(dict(GOOD_MANIFEST_DOC, version=2)).encode(), "m.json")
    with pytest.raises(InvalidCheckpoint, match=newer):
        Marker.from_json(json.dumps(dict(GOOD_MARKER_DOC, version=2)).encode(), "COMMITTED")
    outer = json.dumps({**GOOD_SHARD_DOC, "__metadata__": {"ckptctl": json.dumps(dict(GOOD_SHARD_META, version=2))}}).encode()
    with pytest.raises(InvalidCheckpoint, match=newer):
        parse_header(struct.pack("<Q", len(outer)) + outer + bytes(38), len(outer) + 46, "s")
    for bad in (0, -1, "1", 1.0, True, None):
        with pytest.raises(InvalidCheckpoint, match="version"):
            Marker.from_json(json.dumps(dict(GOOD_MARKER_DOC, version=bad)).encode(), "COMMITTED")


def test_load_json_bounds() -> None:
    ok = parse.load_json(b'{"a": [1, 2.5, "x"]}', "f", "doc", max_bytes=100)
    assert ok == {"a": [1, 2.5, "x"]}
    for raw, why in [(b"NaN", "non-finite"), (b"[Infinity]", "non-finite"), (b"1e400", "overflows"),
                     (b"1" * 41, "digits"), (b"1" * 5000, "digits"), (b'"\\ud800"', "Unicode"),
                     (b"\xff", "UTF-8"), (b"x" * 10_001, "more than"), (b"[" * 50 + b"]" * 50, "nested")]:
        with pytest.raises(InvalidCheckpoint, match=why):
            parse.load_json(raw, "f", "doc", max_bytes=10_000, max_depth=20)
    assert parse.load_json(b"[NaN]", "f", "doc", max_bytes=100, allow_nonfinite=True)[0] != 0


# --- end to end, through the real CLI ------------------------------------------------------

def _check_root_verbs(root: str, older: str, newest_invalid: bool) -> None:
    """ls, latest and verify --latest: exit 0/1, never 3, no traceback (cli() re-raises any
    exception); latest names the older checkpoint whenever the newest is invalid."""
    for args in (["ls", root], ["ls", root, "--json"], ["latest", root], ["verify", "--latest", root]):
        r = cli(*args)
        assert r.exit_code in (0, 1), (args, r.exit_code, r.stderr)
        assert "Traceback" not in r.stderr
        if args[0] == "latest":
            assert r.exit_code == 0, r.stderr
            if newest_invalid:
                assert r.stdout.strip() == older, (r.stdout, r.stderr)


def _committed_pair(manifest_raw: bytes, marker_doc: dict[str, Any] | None = None) -> dict[str, bytes]:
    """A manifest and a marker that commits exactly those bytes (so the manifest parser runs)."""
    mk = copy.deepcopy(marker_doc or {"format": "ckptctl-commit", "version": 1, "step": 2, "committed": 1.7e9,
                                      "manifest": {"algorithm": "xxh3-64"}})
    mk["manifest"].update(size=len(manifest_raw), checksum=digest(manifest_raw))
    return {MANIFEST: manifest_raw, MARKER: json.dumps(mk).encode()}


def _is_invalid(files: dict[str, bytes]) -> bool:
    try:
        marker = Marker.from_json(files[MARKER], "COMMITTED")
        marker.check(files[MANIFEST], "m")
        m = Manifest.from_json(files[MANIFEST], "m")
    except InvalidCheckpoint:
        return True
    return m.step != 2 or marker.step != 2


def test_root_verbs_skip_hostile_newest_checkpoint(good_root: str) -> None:
    newest, older = ckpt_dir(good_root, 2), ckpt_dir(good_root, 1)
    original = _saved(newest)
    manifest_doc = json.loads(original[MANIFEST])
    marker_doc = json.loads(original[MARKER])

    def hostile_pair(p: Any) -> dict[str, bytes]:
        which = p.choice(["manifest", "manifest", "marker", "both"])
        if which == "manifest":
            return _committed_pair(hostile_bytes(p, manifest_doc), marker_doc)
        if which == "marker":
            return {MANIFEST: original[MANIFEST], MARKER: hostile_bytes(p, marker_doc)}
        return {MANIFEST: hostile_bytes(p, manifest_doc), MARKER: hostile_bytes(p, marker_doc)}

    @settings(max_examples=30, derandomize=True, **_SETTINGS)
    @given(st.data())
    def prop(data: Any) -> None:
        files = hostile_pair(DataPick(data))
        _put(newest, files)
        _check_root_verbs(good_root, older, _is_invalid(files))

    try:
        prop()
    finally:
        _put(newest, original)


def _explicit_cases(original: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    man, mk = original[MANIFEST], json.loads(original[MARKER])

    def marker(**manifest_fields: Any) -> bytes:
        return json.dumps(dict(mk, manifest=dict(mk["manifest"], **manifest_fields)), allow_nan=True).encode()

    grown = json.dumps(json.loads(man), indent=4).encode()  # reformatted after commit
    return {
        "manifest grew after commit": {MANIFEST: grown, MARKER: original[MARKER]},
        "negative manifest.size": {MANIFEST: man, MARKER: marker(size=-1)},
        "infinite manifest.size": {MANIFEST: man, MARKER: marker(size=float("inf"))},
        "huge manifest.size": {MANIFEST: man, MARKER: marker(size=2**63)},
        "marker over 1 MiB": {MANIFEST: man, MARKER: original[MARKER] + b" " * (1 << 20)},
        "deep marker": {MANIFEST: man, MARKER: deep_bytes(5000)},
        "deep manifest": _committed_pair(deep_bytes(5000), mk),
        "deep manifest state": _committed_pair(man.replace(b'"state": {', b'"state": {"deep": ' + deep_bytes(999) + b", ", 1), mk),
        "NaN created": _committed_pair(man.replace(b'"created": ', b'"created": NaN, "x": ', 1), mk),
        "huge shape": _committed_pair(
            json.dumps(dict(json.loads(man), tensors={n: dict(t, shape=[2**62, 2**62]) for n, t in json.loads(man)["tensors"].items()}),
                       allow_nan=True).encode(), mk),
        "newer version": _committed_pair(json.dumps(dict(json.loads(man), version=2)).encode(), mk),
        "not UTF-8": _committed_pair(b"\xff\xfe" + man, mk),
    }


CASES = ["manifest grew after commit", "negative manifest.size", "infinite manifest.size", "huge manifest.size",
         "marker over 1 MiB", "deep marker", "deep manifest", "deep manifest state", "NaN created", "huge shape",
         "newer version", "not UTF-8"]


@pytest.mark.parametrize("case", CASES)
def test_root_verbs_skip_each_reproduced_case(good_root: str, case: str) -> None:
    newest, older = ckpt_dir(good_root, 2), ckpt_dir(good_root, 1)
    original = _saved(newest)
    try:
        _put(newest, _explicit_cases(original)[case])
        _check_root_verbs(good_root, older, True)
        r = cli("verify", newest)
        assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr
    finally:
        _put(newest, original)
    assert cli("latest", good_root).stdout.strip() == newest  # put back: the newest again


def test_fifo_manifest_is_refused_without_blocking(good_root: str) -> None:
    """A FIFO where the manifest belongs: refused as corrupt, never opened for a blocking read."""
    newest, older = ckpt_dir(good_root, 2), ckpt_dir(good_root, 1)
    original = _saved(newest)
    os.unlink(os.path.join(newest, MANIFEST))
    os.mkfifo(os.path.join(newest, MANIFEST))
    try:
        _check_root_verbs(good_root, older, True)
    finally:
        os.unlink(os.path.join(newest, MANIFEST))
        _put(newest, original)


def test_unsupported_tensors_and_keys_raise_state_error_naming_the_key(tmp_path: Any) -> None:
    from ckptctl import Checkpointer
    from ckptctl.errors import StateError

    cases = {
        "complex128": torch.zeros(2, dtype=torch.complex128),
        "sparse": torch.zeros(3).to_sparse(),
        "meta": torch.empty(3, device="meta"),
        "quantized": torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
    }
    with Checkpointer(str(tmp_path)) as ckpt:
        for i, (what, t) in enumerate(cases.items()):
            with pytest.raises(StateError, match=f"'extra/{what}'") as e:
                ckpt.save(i + 1, {"extra": {what: t}}).wait()
            assert e.value.hint and "dense" in e.value.hint
        with pytest.raises(StateError, match="not valid Unicode"):
            ckpt.save(10, {"extra": {"\ud800": 1}}).wait()
        with pytest.raises(StateError, match="not valid Unicode"):
            ckpt.save(11, {"extra": {"k": "\udfff"}}).wait()
        with pytest.raises(StateError, match="nested more than"):
            ckpt.save(12, {"extra": nest(60, kind="dict")}).wait()


def test_manifest_state_tree_is_checked_and_agrees_with_the_encoder() -> None:
    from ckptctl.state import tree

    assert (parse.STATE_TENSOR, parse.STATE_TUPLE, parse.STATE_ITEMS) == (tree.TENSOR, tree.TUPLE, tree.ITEMS)
    for bad in ({"__items__": 5}, {"__items__": [[1, 2, 3]]}, {"__tensor__": 1}, {"__tuple__": {}},
                {"__tensor__": "a", "x": 1}, [{"__items__": [[[], 1]]}]):
        raw = json.dumps(dict(GOOD_MANIFEST_DOC, state={"k": bad})).encode()
        with pytest.raises(InvalidCheckpoint, match="malformed"):
            Manifest.from_json(raw, "m.json")
    ok = {"k": {"__items__": [[1, {"__tuple__": [1, {"__tensor__": "model/w"}]}]]}}
    assert Manifest.from_json(json.dumps(dict(GOOD_MANIFEST_DOC, state=ok)).encode(), "m.json").state == ok


# --- every sidecar of every other stack's layout --------------------------------------------
# (trust issue, case 12) Each JSON a layout or reader parses goes through format/parse: a hostile
# one is a problem in a one-line report for that checkpoint, never an exception, never exit 3,
# and never a failure of the whole root.

def _torch_zip_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0), "step": 3}, buf)
    return buf.getvalue()


SIDECAR_DOCS: dict[str, Any] = {
    "trainer_state.json": {"global_step": 200, "best_model_checkpoint": None, "log_history": [{"loss": 1.5, "step": 10}]},
    "model.safetensors.index.json": GOOD_INDEX_DOC,
    "integrity.json": {"common.pt": "0" * 64},
    "metadata.json": {"sharded_backend": "torch_dist", "sharded_backend_version": 1},
    "config.json": {"model_type": "gpt2", "n_layer": 2},
}


@pytest.mark.parametrize("name", sorted(SIDECAR_DOCS))
def test_layout_json_sidecars_are_parsed_by_the_bounded_parser(tmp_path: Any, name: str) -> None:
    from ckptctl.layouts import safe_load

    path = str(tmp_path / name)
    for s in (0, SEED):
        pick = RandomPick(random.Random(s))
        for i in range(200):
            raw = hostile_bytes(pick, SIDECAR_DOCS[name])
            with open(path, "wb") as f:
                f.write(raw)
            try:
                doc, problem = safe_load.json_file(*at(path))
            except Exception as e:  # re-raised, naming the seed and the document
                raise AssertionError(f"document {i} of seed {s}: {type(e).__name__}: {e}\n{raw[:200]!r}") from e
            assert (doc is None) != (problem is None) or (doc is None and problem is None and raw.strip() == b"null")
            if problem is not None:
                assert "\n" not in problem and problem


def test_safetensors_headers_and_torch_zips_fuzzed_never_raise(tmp_path: Any) -> None:
    from ckptctl.layouts import safe_load

    good_header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    zipped = _torch_zip_bytes()
    st_path, pt_path = str(tmp_path / "m.safetensors"), str(tmp_path / "f.pt")
    for s in (0, SEED):
        pick = RandomPick(random.Random(s))
        for i in range(300):
            header = hostile_bytes(pick, good_header)
            with open(st_path, "wb") as f:
                f.write(struct.pack("<Q", len(header)) + header + bytes(pick.int(0, 16)))
            i_flip = pick.int(0, len(zipped) - 1)
            damaged = bytearray(zipped)
            for _ in range(pick.int(1, 4)):
                damaged[pick.int(0, len(zipped) - 1)] = pick.int(0, 255)
            cut = damaged[: pick.int(0, len(damaged))] if pick.int(0, 3) == 0 else damaged
            with open(pt_path, "wb") as f:
                f.write(bytes(cut))
            try:
                problems = [safe_load.safetensors_header(*at(st_path)), safe_load.zip_structure(*at(pt_path)),
                            safe_load.zip_crc(*at(pt_path))[0]]
            except Exception as e:
                raise AssertionError(f"case {i} (flip at {i_flip}) of seed {s}: {type(e).__name__}: {e}") from e
            assert all(p is None or (p and "\n" not in p) for p in problems), problems


def _megatron_dist(root: str, it: int) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, f"iter_{it:07d}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Megatron saves the optimizer's sharded state under optimizer.* (a resumable iteration)
        dcp.save({"model": {"w": torch.full((4,), float(it))}, "optimizer": {"state": {"w": torch.zeros(4)}}},
                 checkpoint_id=path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(SIDECAR_DOCS["metadata.json"], f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(it))
    return path


def _stack_root(tmp_path: Any, sidecar: str) -> tuple[str, str, str, str]:
    """(root, older, newest, the file to make hostile) for one sidecar of one stack."""
    from test_layouts import dcp_step, deepspeed_tag, hf_checkpoint

    root = str(tmp_path / "root")
    os.makedirs(root)
    if sidecar in ("trainer_state.json", "config.json", "seal", "model.safetensors header"):
        older, newest = hf_checkpoint(root, 100), hf_checkpoint(root, 200)
        if sidecar == "seal":
            assert cli("seal", newest).exit_code == 0
            return root, older, newest, os.path.join(newest, ".ckptctl-seal.json")
        name = "model.safetensors" if sidecar == "model.safetensors header" else sidecar
        return root, older, newest, os.path.join(newest, name)
    if sidecar == "hf index":
        older, newest = hf_checkpoint(root, 100), hf_checkpoint(root, 200)
        with open(os.path.join(newest, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 256}, "weight_map": {"w": "model.safetensors"}}, f)
        return root, older, newest, os.path.join(newest, "model.safetensors.index.json")
    if sidecar == "dcp hf index":
        from safetensors.torch import save_file

        older = dcp_step(root, 100)
        newest = os.path.join(root, "step-200")
        os.makedirs(newest)
        save_file({"w": torch.zeros(2)}, os.path.join(newest, "model-00001-of-00001.safetensors"))
        with open(os.path.join(newest, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 8}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}, f)
        return root, older, newest, os.path.join(newest, "model.safetensors.index.json")
    if sidecar in ("integrity.json", "metadata.json", "megatron tracker"):
        older, newest = _megatron_dist(root, 1000), _megatron_dist(root, 2000)
        if sidecar == "integrity.json":
            with open(os.path.join(newest, "integrity.json"), "w") as f:
                json.dump({}, f)
        target = os.path.join(root, "latest_checkpointed_iteration.txt") if sidecar == "megatron tracker" else \
            os.path.join(newest, sidecar)
        return root, older, newest, target
    assert sidecar == "deepspeed latest"
    older, newest = deepspeed_tag(root, 10), deepspeed_tag(root, 20)
    return root, older, newest, os.path.join(root, "latest")


SIDECARS = ["trainer_state.json", "config.json", "model.safetensors header", "hf index", "seal", "dcp hf index",
            "integrity.json", "metadata.json", "megatron tracker", "deepspeed latest"]
EXPLICIT = [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' + b"1" * 5000 + b"}", b"\xff\xfe{}", b'{"x": 1e999}']


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_root_verbs_skip_a_checkpoint_with_a_hostile_sidecar(tmp_path: Any, sidecar: str) -> None:
    """Every sidecar of every stack, hostile: ls, latest, verify --all and prune --dry-run end
    with 0 or 1 (never 3, never a traceback), and ``latest`` names a checkpoint (the older one
    whenever the newest is refused)."""
    root, older, newest, target = _stack_root(tmp_path, sidecar)
    base = open(target, "rb").read()
    if sidecar == "model.safetensors header":
        base = base[8 : 8 + struct.unpack("<Q", base[:8])[0]]
    try:
        base_doc = json.loads(base)
    except ValueError:
        base_doc = base.decode("utf-8", "replace")
    pick = RandomPick(random.Random(SEED))
    docs = EXPLICIT + [hostile_bytes(pick, base_doc) for _ in range(2)]
    for raw in docs:
        if sidecar == "model.safetensors header":
            raw = struct.pack("<Q", len(raw)) + raw
        with open(target, "wb") as f:
            f.write(raw)
        for args in (["ls", root], ["latest", root], ["verify", root, "--all"], ["prune", root, "--keep-last", "1", "--dry-run"]):
            r = cli(*args)
            assert r.exit_code in (0, 1) and "Traceback" not in r.stderr, (sidecar, raw[:60], args, r.exit_code, r.stderr)
            # A garbled pointer commits nothing by its stack's own rule: refusing (1) is right there.
            if args[0] == "latest" and sidecar in ("integrity.json", "metadata.json") and r.exit_code == 1:
                # Megatron resumes what its tracker names (the refused newest): no plain path
                # resumes the older iteration, so `latest` prints none and the argv pins it.
                assert r.stdout == "" and "--resume-args" in r.stderr, (sidecar, raw[:60], r.stdout, r.stderr)
                pinned = cli("latest", root, "--resume-args")
                assert pinned.exit_code == 0 and "--ckpt-step 1000" in pinned.stdout, (sidecar, pinned.stdout, pinned.stderr)
            elif args[0] == "latest" and sidecar not in ("megatron tracker", "deepspeed latest"):
                assert r.exit_code == 0 and r.stdout.strip() in (older, newest, root), (sidecar, raw[:60], r.stdout, r.stderr)
        if sidecar not in ("megatron tracker", "deepspeed latest"):
            r = cli("verify", newest)
            assert r.exit_code in (0, 1) and "Traceback" not in r.stderr, (sidecar, raw[:60], r.stderr)


# --- hostile pickles in accelerate's random_states (issue 29 item 6, the pickle part) ----------------

BINBYTES8_2_62 = b"\x8e" + struct.pack("<Q", 1 << 62)  # "2^62 bytes follow", and none do


def _accelerate_save(path: str) -> None:
    """A save_state directory as accelerate writes it for one process (model, optimizer, RNG)."""
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({"w": torch.ones(4)}, os.path.join(path, "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, os.path.join(path, "optimizer.bin"))
    torch.save({"step": 0, "torch_manual_seed": torch.ones(2, dtype=torch.uint8)},
               os.path.join(path, "random_states_0.pkl"))


def _zip_with_pickle(pickled: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pickled``."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


HOSTILE_RNG = {
    "protocol-4 pickle": b"\x80\x04" + BINBYTES8_2_62,  # 11 bytes: ls died in zipfile's seek before the fix
    "legacy pickle": b"\x80\x02" + BINBYTES8_2_62 + b"xx",
    "zip data.pkl": _zip_with_pickle(b"\x80\x02" + BINBYTES8_2_62 + b"."),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_RNG))
def test_a_hostile_accelerate_rng_pickle_is_a_checkpoint_problem_named(tmp_path: Any, case: str) -> None:
    """ls, latest, verify (every level), prune and du: 0 or 1, never 3 or "internal error"; the
    file is named; latest takes the older save."""
    root = str(tmp_path / "checkpoints")
    older, newest = os.path.join(root, "checkpoint_0"), os.path.join(root, "checkpoint_1")
    _accelerate_save(older)
    _accelerate_save(newest)
    with open(os.path.join(newest, "random_states_0.pkl"), "wb") as f:
        f.write(HOSTILE_RNG[case])
    for args in (["ls", root], ["du", root], ["prune", root, "--keep-last", "1", "--dry-run"],
                 ["verify", root, "--all"]):
        r = cli(*args)
        assert r.exit_code in (0, 1) and "internal error" not in r.stderr + r.stdout, (case, args, r.stderr)
    r = cli("latest", root, "--level", "load")
    assert r.exit_code == 0 and r.stdout.strip() == older, (case, r.stdout, r.stderr)
    r = cli("verify", newest, "--load")
    assert r.exit_code == 1 and "random_states_0.pkl" in r.stdout + r.stderr, (case, r.stdout, r.stderr)
    if case != "zip data.pkl":  # a whole archive with whole CRC-32s: only decoding its pickle tells
        r = cli("verify", newest, "--quick")
        assert r.exit_code == 1 and "random_states_0.pkl" in r.stdout + r.stderr, (case, r.stdout, r.stderr)


# --- hostile files in the newer layouts' records and sidecars (issue 29, item 6) -------------
# Not a document but the file itself: what a full disk, a sparse copy or an attacker leaves
# under a record's name. Each is a corrupt checkpoint (exit 1, named), and `latest` skips it.

SPECIAL_FILES = ["fifo", "sparse 100 GB", "random bytes", "a directory", "a symlink to /dev/zero"]


def make_special(path: str, how: str) -> None:
    """Replace the file at ``path`` with ``how`` (one of ``SPECIAL_FILES``)."""
    if os.path.isdir(path) and not os.path.islink(path):
        import shutil

        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "sparse 100 GB":
        with open(path, "wb") as f:
            f.truncate(100 * 10**9)  # no block written: any filesystem holds it
    elif how == "random bytes":
        with open(path, "wb") as f:
            f.write(random.Random(f"{path}:{SEED}").randbytes(3000))
    elif how == "a directory":
        os.makedirs(path)
    else:
        assert how == "a symlink to /dev/zero"
        os.symlink("/dev/zero", path)


def assert_hostile_checkpoints_skipped(root: str, good: str, hostile: dict[str, str], *,
                                       verify_named: bool = True) -> None:
    """``hostile`` maps each newer checkpoint of ``root`` to the file made hostile in it: the
    root-wide verbs end with 0 or 1 (never 3, never an internal error), ``latest`` prints
    ``good`` (older than every hostile one), and each hostile checkpoint fails ``verify``
    (exit 1) naming its file."""
    for args in (["ls", root], ["ls", root, "--json"], ["du", root], ["verify", root, "--all"],
                 ["prune", root, "--keep-last", "1", "--dry-run"]):
        r = cli(*args)
        assert r.exit_code in (0, 1) and "internal error" not in r.stderr and "Traceback" not in r.stderr, \
            (args, r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout == good + "\n", (r.stdout, r.stderr)
    for ckpt, name in hostile.items():
        r = cli("verify", ckpt)
        assert r.exit_code == 1 and "internal error" not in r.stderr, (ckpt, name, r.exit_code, r.stdout, r.stderr)
        if verify_named:
            assert os.path.basename(name) in r.stdout + r.stderr, (ckpt, name, r.stdout, r.stderr)


def test_a_special_or_huge_seal_is_a_corrupt_checkpoint_and_latest_skips_it(tmp_path: Any) -> None:
    """A 100 GB sparse ``.ckptctl-seal.json`` was exit 3 (a "storage error") and made ``latest``
    give up instead of skipping that checkpoint."""
    from test_layouts import hf_checkpoint

    root = str(tmp_path / "root")
    os.makedirs(root)
    good = hf_checkpoint(root, 100)
    hostile = {}
    for i, how in enumerate(SPECIAL_FILES):
        ckpt = hf_checkpoint(root, 200 + i)
        assert cli("seal", ckpt).exit_code == 0
        make_special(os.path.join(ckpt, ".ckptctl-seal.json"), how)
        hostile[ckpt] = ".ckptctl-seal.json"
    assert_hostile_checkpoints_skipped(root, good, hostile)


def _torch_file_root(tmp_path: Any, layout: str) -> tuple[str, str, str]:
    """(root, newest checkpoint, its torch.save file) of a real save by ``layout``'s stack, an
    older complete checkpoint beside it."""
    from test_composer_nemo import composer_save
    from test_layouts import deepspeed_tag
    from test_protection import _lightning_file

    root = str(tmp_path / "root")
    if layout == "lightning":
        _lightning_file(root, 5, callbacks={})
        newest = _lightning_file(root, 10, callbacks={})
        return root, newest, newest
    if layout == "composer":
        composer_save(root, 0, 5)
        newest = composer_save(root, 1, 10)
        return root, newest, newest
    os.makedirs(root)
    deepspeed_tag(root, 5)
    newest = deepspeed_tag(root, 10)
    return root, newest, os.path.join(newest, "mp_rank_00_model_states.pt")


@pytest.mark.parametrize("layout", ["lightning", "composer", "deepspeed"])
def test_every_flip_in_a_torch_files_end_records_is_corrupt(tmp_path: Any, layout: str) -> None:
    """A flipped byte in the last 100 bytes of a real torch.save file (its central directory's
    end, the zip64 end record and locator, the end record) makes ``verify`` exit 1 naming the
    file, never 3 (zipfile's BadZipFile once escaped the commit rule of Lightning and Composer),
    and ``latest`` answers the older checkpoint.

    Four bytes are read by no reader: the zip64 end record's "version made by" and "version
    needed to extract" (torch's miniz and Python's zipfile both skip them). A flip there may
    verify ok, and only if torch.load gives back exactly what the intact file holds."""
    root, newest, target = _torch_file_root(tmp_path, layout)
    intact = open(target, "rb").read()
    size = len(intact)
    assert intact[-42:-38] == b"PK\x06\x07", "torch.save writes zip64 end records always"
    z64 = struct.unpack_from("<Q", intact, size - 42 + 8)[0]
    unused = range(z64 + 12, z64 + 16)
    want = torch.load(target, weights_only=False, map_location="cpu")  # the test's own file: trusted
    for at in range(size - 100, size):
        damaged = bytearray(intact)
        damaged[at] ^= 0xFF
        with open(target, "wb") as f:
            f.write(damaged)
        r = cli("verify", newest)
        where = f"flip at byte {at} of {size}"
        assert r.exit_code in (0, 1), f"{where}: exit {r.exit_code}: {r.stdout[-600:]}{r.stderr[-600:]}"
        if r.exit_code == 0:
            assert at in unused, f"{where}: verified ok: {r.stdout[-600:]}"
            got = torch.load(target, weights_only=False, map_location="cpu")
            assert repr(got) == repr(want), f"{where}: verified ok but loads differently"
            continue
        assert os.path.basename(target) in r.stdout and "internal error" not in r.stderr, f"{where}: {r.stdout[-600:]}"
        latest = cli("latest", root, "--json")
        assert latest.exit_code == 0 and latest.json()["step"] == 5, f"{where}: {latest.stdout[-600:]}{latest.stderr}"
    with open(target, "wb") as f:
        f.write(intact)
    assert cli("verify", newest).exit_code == 0
