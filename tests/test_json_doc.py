"""man/ckptctl-json.7 documents every verb's --json, and the fields it names are the fields
the verbs print: "url" for a location, "bytes" for a size, "schema" everywhere."""

from __future__ import annotations

import os
import re
from pathlib import Path

import typer.main
from helpers import ckpt_dir, cli, make_checkpoints

from ckptctl.cli.app import app
from ckptctl.cli.json_names import RENAMED_IN_2, objects_at

PAGE = (Path(__file__).resolve().parent.parent / "man" / "ckptctl-json.7").read_text()


def _verb_paragraphs() -> dict[str, str]:
    """Each .TP entry of the VERBS section: the verbs its header names -> its text."""
    section = PAGE.split(".SH VERBS", 1)[1].split(".SH ", 1)[0]
    out: dict[str, str] = {}
    for entry in section.split(".TP\n")[1:]:
        header, _, body = entry.partition("\n")
        for verb in re.findall(r"[a-z]+", header.replace(".BR", "").replace(".B", "")):
            out[verb] = body
    return out


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z_]+", text))


def test_every_verb_is_documented() -> None:
    verbs = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert verbs <= set(_verb_paragraphs()), f"not in man/ckptctl-json.7: {sorted(verbs - set(_verb_paragraphs()))}"


# Per verb: the fields the page names for it, each of which must be in the printed document
# (anywhere in it: top level, or in the per-checkpoint objects).
FIELDS = {
    "ls": ["url", "checkpoints", "counts", "bytes", "step", "name", "status", "created", "age_s", "reason", "layout"],
    "du": ["url", "bytes", "policy", "refused", "bytes_freed", "checkpoints_freed", "notes", "checkpoints", "prune",
           "scratch", "scratch_bytes", "scratch_bytes_freed"],
    "rm": ["dry_run", "confirmed", "bytes", "notes", "checkpoints", "url", "status", "result", "detail", "anchor"],
    "sync": ["src", "dst", "dry_run", "bytes", "seconds", "notes", "counts", "checkpoints", "url", "action", "detail"],
    "prune": ["dry_run", "plan", "root", "policy", "anchor", "refused", "items", "status", "action", "reason", "bytes", "outcome"],
    "cp": ["url", "bytes", "step", "src", "dst", "status", "files", "files_reused", "seconds"],
    "verify": ["ok", "level", "checkpoints", "url", "step", "problems", "bytes_read"],
    "latest": ["url", "step", "level", "layout", "resume", "skipped", "content", "skipped_exports"],
    "inspect": ["url", "step", "bytes", "files", "tensors", "content"],
    "restore": ["url", "bytes", "step", "path", "copy", "skipped"],
    "seal": ["url", "ok", "checkpoints", "layout", "status", "bytes"],
}


def test_documented_fields_are_printed(tmp_path) -> None:
    root = str(tmp_path / "root")
    make_checkpoints(root, [1, 2, 3])
    docs = {
        "ls": cli("ls", root, "--json").json(),
        "du": cli("du", root, "--keep-last", "2", "--json").json(),
        "rm": cli("rm", ckpt_dir(root, 1), "--dry-run", "--json").json(),
        "sync": cli("sync", root, str(tmp_path / "mirror"), "--json").json(),
        "prune": cli("prune", root, "--keep-last", "2", "--dry-run", "--json").json(),
        "cp": cli("cp", ckpt_dir(root, 3), str(tmp_path / "copy"), "--json").json(),
        "verify": cli("verify", root, "--all", "--json").json(),
        "latest": cli("latest", root, "--json").json(),
        "inspect": cli("inspect", ckpt_dir(root, 3), "--json").json(),
        "restore": cli("restore", root, str(tmp_path / "restored"), "--json").json(),
        "seal": cli("seal", root, "--json").json(),
    }
    paragraphs = _verb_paragraphs()
    for verb, fields in FIELDS.items():
        doc = docs[verb]
        assert doc["schema"] == 2, verb
        for field in fields:
            assert field in _words(paragraphs[verb]), f"man/ckptctl-json.7 does not name {verb}'s {field!r}"
            assert field in _all_keys(doc), f"{verb} --json has no {field!r}, which man/ckptctl-json.7 names"


def _all_keys(doc: object) -> set[str]:
    if isinstance(doc, dict):
        return set(doc) | {k for v in doc.values() for k in _all_keys(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in _all_keys(v)}
    return set()


def _docs_of_renamed_verbs(tmp_path) -> dict[str, dict]:
    """One document of each verb whose names changed in schema 2, as printed now."""
    root = str(tmp_path / "root")
    make_checkpoints(root, [1, 2, 3])
    return {
        "latest": cli("latest", root, "--json").json(),
        "prune": cli("prune", root, "--keep-last", "2", "--dry-run", "--json").json(),
        "inspect": cli("inspect", ckpt_dir(root, 3), "--json").json(),
        "cp": cli("cp", ckpt_dir(root, 3), str(tmp_path / f"copy{len(os.listdir(tmp_path))}"), "--json").json(),
        "restore": cli("restore", root, str(tmp_path / f"restored{len(os.listdir(tmp_path))}"), "--json").json(),
        "seal": cli("seal", root, "--json").json(),
    }


def _has(doc: dict, where: str, name: str) -> bool:
    return any(name in obj for obj in objects_at(doc, where))


def test_schema_2_prints_each_idea_under_one_name(tmp_path) -> None:
    docs = _docs_of_renamed_verbs(tmp_path)
    for verb, doc in docs.items():
        assert doc["schema"] == 2, verb
        for where, old, new in RENAMED_IN_2[verb]:
            assert objects_at(doc, where), f"{verb}: nothing at {where!r} to check"
            assert _has(doc, where, new) and not _has(doc, where, old), (verb, where, old, new)


def test_schema_1_names_on_request(tmp_path, monkeypatch) -> None:
    # A script written for schema 1 keeps working while it is updated: old names beside the new.
    monkeypatch.setenv("CKPTCTL_JSON_SCHEMA", "1")
    docs = _docs_of_renamed_verbs(tmp_path)
    for verb, doc in docs.items():
        assert doc["schema"] == 1, verb
        for where, old, new in RENAMED_IN_2[verb]:
            assert _has(doc, where, old), (verb, where, old)
    error = cli("latest", str(tmp_path / "missing"), "--json")
    assert error.exit_code == 2 and error.json()["schema"] == 1


def test_a_bad_schema_request_is_a_usage_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CKPTCTL_JSON_SCHEMA", "3")
    r = cli("ls", str(tmp_path), "--json")
    assert r.exit_code == 2 and "CKPTCTL_JSON_SCHEMA" in r.stderr
    assert r.json()["schema"] == 2 and r.json()["error"]["type"] == "UsageError"
