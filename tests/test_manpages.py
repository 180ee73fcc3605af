"""Manual pages: the committed pages are what scripts/gen_man.py makes from the Typer app,
every verb has one, each has its sections, and groff reads them all without a warning."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import typer.main

REPO = Path(__file__).resolve().parent.parent
MAN = REPO / "man"
REGENERATE = "run `python scripts/gen_man.py` and commit man/"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_man", REPO / "scripts" / "gen_man.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
VERBS = list(gen.verbs(typer.main.get_command(gen.app)))
PAGES = sorted(MAN.glob("*.[1-9]"))

VERB_SECTIONS = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "EXAMPLES", "SEE ALSO"]
REQUIRED_SECTIONS = {
    "ckptctl.1": ["NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO"],
    "ckptctl-format.5": [
        "NAME", "DESCRIPTION", "LAYOUT", "SHARD FILES", "MANIFEST", "MARKER", "CHECKSUMS",
        "NON-TENSOR STATE", "COMMIT PROTOCOL", "COMPATIBILITY", "SEE ALSO",
    ],
    "ckptctl-json.7": ["NAME", "DESCRIPTION", "CONVENTIONS", "ERRORS", "VERBS", "EXAMPLES", "SEE ALSO"],
    "ckptctl-integrations.7": ["NAME", "DESCRIPTION", "INTEGRATIONS", "SEE ALSO"],
    "ckptctl-layouts.7": [
        "NAME", "DESCRIPTION", "LAYOUTS", "RULES AND SOURCES", "VERIFY LEVELS", "PRUNE", "EXAMPLES", "SEE ALSO",
    ],
}


def _page_name(path: tuple[str, ...]) -> str:
    return f"ckptctl-{'-'.join(path)}.1"


def test_committed_pages_match_the_generator() -> None:
    problems = gen.differences(gen.render(), gen.committed())
    assert not problems, f"man pages are out of date ({', '.join(problems)}): {REGENERATE}"


def test_check_mode_passes_on_the_committed_pages() -> None:
    done = subprocess.run([sys.executable, "scripts/gen_man.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", [p for p, _ in VERBS], ids="-".join)
def test_every_verb_has_a_page(path: tuple[str, ...]) -> None:
    assert (MAN / _page_name(path)).is_file(), f"no man/{_page_name(path)}: {REGENERATE}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_has_required_sections(page: Path) -> None:
    found = [s.strip('"').replace("\\-", "-") for s in re.findall(r"^\.SH (.+)$", page.read_text(), re.M)]
    required = REQUIRED_SECTIONS.get(page.name, VERB_SECTIONS)
    missing = [s for s in required if s not in found]
    assert not missing, f"{page.name} lacks sections {missing}"
    assert [s for s in found if s in required] == required, f"{page.name}: sections out of order"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed (apt-get install groff-base)")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_groff_reads_page_without_warnings(page: Path) -> None:
    done = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout + done.stderr == "", f"{page.name}:\n{done.stderr}{done.stdout}"


@pytest.mark.parametrize(("path", "cmd"), VERBS, ids=[_page_name(p) for p, _ in VERBS])
def test_page_documents_every_option_and_argument(path: tuple[str, ...], cmd: object) -> None:
    text = gen.render()[_page_name(path)]
    options = text.split(".SH OPTIONS")[1].split(".SH ")[0]
    for p in gen.params(cmd):
        names = [gen.ital(gen.metavar(p))] if gen.is_argument(p) else [gen.bold(o) for o in p.opts]
        assert all(n in options for n in names), f"{_page_name(path)} does not document {p.name}"


@pytest.mark.parametrize(("path", "cmd"), VERBS, ids=[_page_name(p) for p, _ in VERBS])
def test_examples_use_only_options_the_verb_has(path: tuple[str, ...], cmd: object) -> None:
    known = {o for p in gen.params(cmd) for o in [*p.opts, *getattr(p, "secondary_opts", [])]}
    known |= set(gen.help_names())
    for _, command in gen.EXAMPLES.get("-".join(path), []):
        invocations = re.findall(rf"ckptctl {' '.join(path)}\b([^|;&)\n]*)", command.replace("\\\n", " "))
        assert invocations, f"example {command!r} does not run ckptctl {' '.join(path)}"
        for words in invocations:
            unknown = set(re.findall(r"(?<!\S)(-{1,2}[A-Za-z][\w-]*)", words)) - known
            assert not unknown, f"EXAMPLES[{'-'.join(path)!r}] in scripts/gen_man.py uses {sorted(unknown)}"


def test_escaping() -> None:
    assert gen.esc("--keep-last") == "\\-\\-keep\\-last"
    assert gen.esc("a\\b") == "a\\eb"
    assert gen.esc(".hidden") == "\\&.hidden"
    assert gen.esc("'quoted'") == "\\(aqquoted\\(aq"
    assert gen.esc("√2 × 3") == "\\[u221A]2 \\[u00D7] 3"


def test_check_and_write_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gen, "MAN_DIR", tmp_path)
    (tmp_path / "ckptctl-format.5").write_text(".TH HAND 5\n")
    assert gen.main([]) == 0
    pages = gen.render()
    assert {p.name for p in tmp_path.iterdir()} == {*pages, "ckptctl-format.5"}
    assert gen.main(["--check"]) == 0

    first, *rest = sorted(pages)
    (tmp_path / first).write_text(pages[first] + ".PP\nedited by hand\n")
    (tmp_path / rest[0]).unlink()
    (tmp_path / "ckptctl-gone.1").write_text(gen.STAMP + "\n.TH OLD 1\n")
    capsys.readouterr()
    assert gen.main(["--check"]) == 1
    report = capsys.readouterr().err
    assert f"stale: man/{first}" in report and f"missing: man/{rest[0]}" in report
    assert "extra: man/ckptctl-gone.1" in report and "python scripts/gen_man.py" in report

    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    assert not (tmp_path / "ckptctl-gone.1").exists()
    assert (tmp_path / "ckptctl-format.5").read_text() == ".TH HAND 5\n"
