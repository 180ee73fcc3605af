"""Every verb's options fuzzed (trust issue, "validated at the edge"): whatever is typed, the
exit status is 0, 1 or 2 (never 3, never a traceback) and no run takes longer than
``HANG_S`` seconds.

Values are drawn from meaningful ones and hostile ones: huge and negative numbers, 1e309, nan,
-0, empty text, unicode digits and names, bytes a real argv carries as surrogates, paths with
NUL, s3:// garbage, special files, unknown flags. Verbs run in-process (typer's runner) against
a small real root of two checkpoints and a moto S3 bucket holding the same; every example gets
its own copy of the root and works in its own scratch directory (the current directory too),
so nothing outside the test's temporary directories is touched and no example sees another's
deletions. A bucket that does not exist is left out: it is an operational error by design
(exit 3, tests/test_storage_conformance.py::test_s3_missing_bucket), like an unreachable store.
Each run is on a thread that must finish within ``HANG_S``; a run that does not is
a hang. The bound is generous: a drawn ``--world-size 1000`` reshard or restore writes a
thousand shards, which took over 10 s on a loaded 2-core machine (about 1 s on a quiet one).
A run past the bound is still waited for (up to five times the bound more) before the next
example: one left going in the background closed the next test's captured stdout when it
finished, a second failure that hid the first.

The default run is small (``EXAMPLES`` per verb, derandomized so that CI sees the same
examples); the ``slow`` one draws many more at random. ``CKPTCTL_FUZZ_EXAMPLES`` and
``CKPTCTL_FUZZ_HANG_S`` override both numbers.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import boto3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptctl.cli.app import app
from helpers import ckpt_dir, make_checkpoints

HANG_S = float(os.environ.get("CKPTCTL_FUZZ_HANG_S", "60"))
EXAMPLES = int(os.environ.get("CKPTCTL_FUZZ_EXAMPLES", "6"))
SLOW_EXAMPLES = int(os.environ.get("CKPTCTL_FUZZ_EXAMPLES", "30"))

OUTCOMES: Counter[tuple[str, str]] = Counter()  # (verb, "exit N" | "hang") -> examples


@dataclass(frozen=True)
class Places:
    """Where an example may point a verb. ``root`` and ``s3_root`` hold steps 1 and 2."""

    pristine: str
    s3_root: str
    s3_bucket: str
    plain_file: str


@pytest.fixture(scope="module")
def places(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Places]:
    base = tmp_path_factory.mktemp("fuzz-pristine")
    pristine = str(base / "root")
    make_checkpoints(pristine, [1, 2], size=64)
    plain = base / "notes.txt"
    plain.write_text("not a checkpoint\n")
    bucket = f"ckptctl-fuzz-{uuid.uuid4().hex[:12]}"
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request at INFO
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", s3_server)
        mp.setenv("AWS_MAX_ATTEMPTS", "2")  # a refused connection is reported, not retried for long
        boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
        s3_root = f"s3://{bucket}/root"
        make_checkpoints(s3_root, [1, 2], size=64)
        yield Places(pristine, s3_root, bucket, str(plain))
    print("\noption fuzz outcomes:", dict(sorted(OUTCOMES.items())),
          f"\noption fuzz examples: {sum(OUTCOMES.values())}")


# --- values ------------------------------------------------------------------------------------

def mostly(good: list[str], hostile: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A meaningful value three times in four, so that most runs get past parsing into the
    verb's own checks; else a hostile one."""
    return st.integers(0, 3).flatmap(lambda i: hostile if i == 3 else st.sampled_from(good))  # shrinks to good


HOSTILE_TEXT = ["", " ", "-", "--", "\x00", "a\x00b", "\udcff\udcfe", "é", "名前", "\u202e", "\n", "x" * 300,
                "%s%n", "$(id)", "../..", "-h"]
# What a real argv can hold: no NUL and no surrogate but the ones that stand for undecodable
# bytes. NUL is in HOSTILE_TEXT anyway: a library caller can pass one.
# Random text never holds a "/": as a path it stays one name in the example's scratch directory
# (a drawn "/tmp" or "../../.." handed to prune or rm would reach outside the test's tree).
texts = st.one_of(st.sampled_from(HOSTILE_TEXT),
                  st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/"), max_size=12))

HOSTILE_INTS = ["-0", "+1", "-1", str(2**20 + 1), str(2**31), str(2**63 - 1), str(2**63), str(2**64),
                "99999999999999999999999999", "9" * 4299, "9" * 4301, "1e309", "nan", "inf", "-inf", "1.5", "", " 2",
                "0x10", "1_000", "\u0661\u0662", "\u00b2"]
ints = mostly(["0", "1", "2", "3", "7", "1000"], st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(-5, 40).map(str), texts))

HOSTILE_DURATIONS = ["0", "0s", "-5s", "nan", "inf", "1e309", "9" * 400, "", "1h1h", "30m1h", "5 parsecs", "\u0663s",
                     "1.s", "99999999999999999999w", ".5s"]
durations = mostly(["90s", "15m", "1h30m", "1.5h", "7d", "1w", "850ms", "2h 5m", "30"],
                   st.one_of(st.sampled_from(HOSTILE_DURATIONS), texts))

HOSTILE_SIZES = ["1e309", "nan", "inf", "-0", "0", "0.4", "1e-300", "", "5XB", "-5GB", "9" * 5000, "8 PiB", "1e99999999"]
sizes = mostly(["5GB", "500MiB", "1000", "1", "1.5gb", " 2 GiB ", "1e9", "300"], st.one_of(st.sampled_from(HOSTILE_SIZES), texts))

FLAGS = ["--json", "--quiet", "-q", "--bogus", "--", "-x", "--help", "--debug=1", "--json=1"]


def s3_garbage(p: Places) -> list[str]:
    return ["s3://", "s3:///x", "s3:/bucket", "s3://Bad_Bucket!/x", f"s3://{p.s3_bucket}/../x",
            f"s3://{p.s3_bucket}/a//b", f"s3://{p.s3_bucket}/x\x00y",
            f"s3://{p.s3_bucket}/" + "k" * 1100, "S3://x/y", "s4://x/y", "file://remote/x", "file://", "http://x/y"]


def sources(p: Places, root: str) -> st.SearchStrategy[str]:
    """An existing thing to read, or something that is not one."""
    good = [root, ckpt_dir(root, 1), ckpt_dir(root, 2), p.s3_root, f"{p.s3_root}/step-0000000002", f"file://{root}"]
    hostile = [os.path.join(root, "missing"), p.plain_file, os.path.join(root, "step-0000000002", "manifest.json"),
               "/dev/null", "/dev/zero", f"{p.s3_root}/missing", *s3_garbage(p)]
    return mostly(good, st.one_of(st.sampled_from(hostile), texts))


def destinations(p: Places, root: str, scratch: str) -> st.SearchStrategy[str]:
    """Somewhere to write: new, existing, in S3, or malformed. Never a system path."""
    fresh_s3 = f"s3://{p.s3_bucket}/out-{uuid.uuid4().hex[:10]}"
    good = [os.path.join(scratch, "out"), os.path.join(scratch, "out", "step-0000000009"), "out", fresh_s3,
            f"{fresh_s3}/step-0000000002"]
    hostile = [".", "..", root, ckpt_dir(root, 2), p.plain_file + "-copy", p.plain_file,
               os.path.join(scratch, "n" * 300), *s3_garbage(p)]
    return mostly(good, st.one_of(st.sampled_from(hostile), texts))


def options(draw: st.DrawFn, table: list[tuple[str, st.SearchStrategy[str] | None]]) -> list[str]:
    """Some of ``table``'s options (None: a flag), each with a drawn value, in a drawn order."""
    chosen = draw(st.lists(st.sampled_from(table), max_size=3))
    argv: list[str] = []
    for name, values in chosen:
        argv.append(name)
        if values is not None:
            argv.append(draw(values))
    return argv


def with_noise(draw: st.DrawFn, argv: list[str]) -> list[str]:
    """``argv`` with perhaps a global flag or an unknown one, and perhaps shuffled."""
    if draw(st.integers(0, 4)) == 0:  # mostly well-formed, so that the verbs get past parsing
        argv = argv + draw(st.lists(st.sampled_from(FLAGS), min_size=1, max_size=2))
    if draw(st.integers(0, 9)) == 0:
        argv = draw(st.permutations(argv))
    return argv


# --- one strategy per verb ---------------------------------------------------------------------

POLICY = [("--keep-last", ints), ("--keep-every", ints), ("--keep-within", durations), ("--keep-hourly", ints),
          ("--keep-daily", ints), ("--keep-weekly", ints), ("--keep-monthly", ints), ("--keep", ints),
          ("--partial-after", durations), ("--delete-broken", None)]

Verb = Callable[[st.DrawFn, Places, str, str], list[str]]


def verb_ls(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["ls", draw(sources(p, root))]


def verb_inspect(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["inspect", draw(sources(p, root)), *options(draw, [("--tensors", None)])]


def verb_verify(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["verify", draw(sources(p, root)),
            *options(draw, [("--quick", None), ("--load", None), ("--latest", None), ("--all", None)])]


def verb_latest(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    levels = mostly(["quick", "checksums", "load"], st.one_of(st.sampled_from(["LOAD", ""]), texts))
    formats = mostly(["ckptctl", "dcp", "hf-trainer", "megatron", "deepspeed", "lightning"], texts)
    return ["latest", draw(sources(p, root)),
            *options(draw, [("--level", levels), ("--format", formats), ("--resume-args", None)])]


def verb_prune(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    target = draw(mostly([root], st.one_of(st.sampled_from([os.path.join(root, "missing"), p.plain_file,
                                                             f"{p.s3_root}-empty", *s3_garbage(p)]), texts)))
    keep = draw(mostly(["--keep-last", "--keep-every", "--keep-within"], st.just("")))
    first = [keep, draw(durations if keep == "--keep-within" else ints)] if keep else []
    mode = draw(mostly(["--dry-run", "--yes"], st.just("")))
    return ["prune", target, *first, *([mode] if mode else []),
            *options(draw, POLICY + [("--dry-run", None), ("--yes", None), ("--reverify", None), ("--seal", None)])]


def verb_du(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["du", draw(sources(p, root)), *options(draw, POLICY)]


def verb_rm(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    ckpts = mostly([ckpt_dir(root, 1), ckpt_dir(root, 2)],
                   st.one_of(st.sampled_from([root, os.path.join(root, "step-0000000077"), p.plain_file,
                                              f"{p.s3_root}-empty/step-0000000001", *s3_garbage(p)]), texts))
    return ["rm", *draw(st.lists(ckpts, max_size=3)),
            *options(draw, [("--yes", None), ("--dry-run", None), ("--force", None)])]


def verb_cp(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["cp", draw(sources(p, root)), draw(destinations(p, root, scratch))]


def verb_restore(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["restore", draw(sources(p, root)), draw(destinations(p, root, scratch)),
            *options(draw, [("--step", ints), ("--world-size", ints)])]


def verb_reshard(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    world = draw(mostly(["1", "2", "3", "5"], ints))
    flag = draw(mostly(["-w", "--world-size"], st.just("")))
    return ["reshard", draw(sources(p, root)), draw(destinations(p, root, scratch)),
            *([flag, world] if flag else []), *options(draw, [("--overwrite", None)])]


def verb_convert(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    formats = mostly(["ckptctl", "safetensors", "torch", "dcp"], st.one_of(st.sampled_from(["SAFETENSORS", "onnx", ""]), texts))
    dtypes = mostly(["bf16", "fp16", "fp32"], st.one_of(st.sampled_from(["int8", "BF16", ""]), texts))
    prefixes = mostly(["model/", "model/w0", "extra/"], st.one_of(st.sampled_from(["", "/", "nothing/"]), texts))
    return ["convert", draw(sources(p, root)), draw(destinations(p, root, scratch)),
            "--to", draw(formats),
            *options(draw, [("--only", prefixes), ("--dtype", dtypes), ("--max-shard-size", sizes), ("--step", ints),
                            ("--strip-prefix", prefixes), ("--overwrite", None)])]


def verb_interval(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    root_arg = draw(st.sampled_from([[], [root], [p.s3_root], [p.plain_file]]))
    mtbf = draw(st.sampled_from([["--mtbf", draw(durations)], []]) if draw(st.integers(0, 4)) == 0 else st.just(["--mtbf", draw(durations)]))
    return ["interval", *root_arg, *mtbf, *options(draw, [("--cost", durations), ("--mtbf", durations)])]


def verb_sync(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["sync", draw(sources(p, root)), draw(destinations(p, root, scratch)),
            *options(draw, [("--delete", None), ("--dry-run", None), ("--allow-empty-source", None)])]


def verb_seal(draw: st.DrawFn, p: Places, root: str, scratch: str) -> list[str]:
    return ["seal", draw(st.sampled_from([root, ckpt_dir(root, 2), os.path.join(root, "missing"), p.plain_file,
                                           f"{p.s3_root}-empty", *s3_garbage(p)]) | texts)]


VERBS: dict[str, Verb] = {
    "ls": verb_ls, "inspect": verb_inspect, "verify": verb_verify, "latest": verb_latest, "prune": verb_prune,
    "du": verb_du, "rm": verb_rm, "cp": verb_cp, "restore": verb_restore, "reshard": verb_reshard,
    "convert": verb_convert, "interval": verb_interval, "sync": verb_sync, "seal": verb_seal,
}


# --- running one example -------------------------------------------------------------------------


@dataclass
class Outcome:
    exit_code: int | None  # None: still running after HANG_S
    stdout: str = ""
    stderr: str = ""
    raised: BaseException | None = None


def run_guarded(argv: list[str], cwd: str) -> Outcome:
    """The CLI on ``argv`` in-process, on a thread given ``HANG_S`` seconds; ``cwd`` is the
    current directory meanwhile, so relative paths land in the example's scratch directory.
    The outcome of a run past ``HANG_S`` has no exit code (a hang), whenever it ends."""
    outcome = Outcome(None)

    def target() -> None:
        try:
            r = CliRunner().invoke(app, argv, catch_exceptions=False)
            outcome.exit_code, outcome.stdout, outcome.stderr = r.exit_code, r.stdout, r.stderr
        except BaseException as e:  # noqa: BLE001  (reported by the test, whatever it is)
            outcome.raised = e

    here = os.getcwd()
    os.chdir(cwd)
    try:
        thread = threading.Thread(target=target, name="ckptctl-fuzz", daemon=True)
        thread.start()
        thread.join(HANG_S)
        if thread.is_alive():
            # A hang is reported as such, but its run must not outlive the example: left going
            # in the background it closed the next test's captured stdout when it ended. Slow,
            # not stuck (a --world-size 1000 restore on a loaded machine) ends within this.
            thread.join(HANG_S * 5)
            return Outcome(None)
    finally:
        os.chdir(here)
    return outcome


def check_example(verb: str, draw: st.DrawFn, places: Places, base: str) -> None:
    example = tempfile.mkdtemp(dir=base)
    try:
        root = os.path.join(example, "root")
        shutil.copytree(places.pristine, root)
        scratch = os.path.join(example, "a", "b", "scratch")
        os.makedirs(scratch)
        argv = with_noise(draw, VERBS[verb](draw, places, root, scratch))
        out = run_guarded(argv, scratch)
        if out.raised is not None:  # escaped the CLI: a traceback in a real process
            OUTCOMES[(verb, "raised")] += 1
            pytest.fail(f"ckptctl {argv!r} raised {out.raised!r}")
        if out.exit_code is None:
            OUTCOMES[(verb, "hang")] += 1
            pytest.fail(f"ckptctl {argv!r} still running after {HANG_S:.0f}s")
        OUTCOMES[(verb, f"exit {out.exit_code}")] += 1
        assert out.exit_code in (0, 1, 2), f"ckptctl {argv!r}: exit {out.exit_code}: {out.stderr[-600:]}"
        assert "Traceback" not in out.stderr, out.stderr
    finally:
        shutil.rmtree(example, ignore_errors=True)


_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("verb", list(VERBS))
@settings(max_examples=EXAMPLES, derandomize=True, **_COMMON)
@given(data=st.data())
def test_every_verb_exits_0_1_or_2_and_never_hangs(verb, data, places, tmp_path_factory):
    check_example(verb, data.draw, places, str(tmp_path_factory.getbasetemp()))


@pytest.mark.slow
@pytest.mark.parametrize("verb", list(VERBS))
@settings(max_examples=SLOW_EXAMPLES, **_COMMON)
@given(data=st.data())
def test_every_verb_under_many_random_examples(verb, data, places, tmp_path_factory):
    check_example(verb, data.draw, places, str(tmp_path_factory.getbasetemp()))
