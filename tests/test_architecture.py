"""The layer rules of docs/architecture.md, checked on the source.

Every module under ``ckptctl/`` is parsed with ``ast`` (nothing is imported, so this runs in well
under a second and without torch). Every import counts: top-level ones, those inside functions,
under ``if TYPE_CHECKING``, in ``try`` blocks, relative ones (resolved), and
``importlib.import_module("ckptctl...")`` calls with a literal name. A lazy import is still a
dependency; it only hides it.

The allowed imports are read from the table in docs/architecture.md, so the page and the test
cannot drift apart: change the table and the test follows. Each failure names the module, the
line and the rule, and every violation is reported at once.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptctl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

ANYTHING = "anything"


# --- the checker ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One import of a ckptctl module: who imports what, where."""

    importer: str  # dotted module name, e.g. "ckptctl.save.commit"
    path: str  # file, relative to the repository root
    line: int
    target: str  # dotted module name imported, resolved

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def unit_of(module: str) -> str:
    """The layer unit a dotted module belongs to: its first component under ``ckptctl``
    (``ckptctl.save.commit`` -> ``save``, ``ckptctl.errors`` -> ``errors``); the package's own
    ``__init__`` is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = _package_of(module, is_package).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str, path: str, is_package: bool,
               known: set[str]) -> list[Import]:
    """Every import of a ``ckptctl`` module in ``source``, wherever it appears in the file.

    ``known`` is the set of dotted module names that exist, so that ``from ckptctl.save import
    commit`` resolves to the module ``ckptctl.save.commit`` and ``from ckptctl import
    Checkpointer`` to the package ``ckptctl`` itself.
    """
    found: list[Import] = []

    def add(target: str, line: int) -> None:
        imp = Import(module, path, line, target)
        if (target == "ckptctl" or target.startswith("ckptctl.")) and imp not in found:
            found.append(imp)

    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                add(arg.value, node.lineno)
    return found


def parse_rules(markdown: str) -> tuple[dict[str, frozenset[str] | None], frozenset[str]]:
    """The import table of docs/architecture.md as ``{unit: allowed units}`` (``None`` for
    "anything"), and the set of leaf units.

    Only the table headed ``| package | may import |`` counts. A row's first cell holds the
    unit names in backticks (one row may name several, like the leaves); the second holds the
    units it may import in backticks, the word ``leaves`` for all leaf units, or ``anything``.
    Every unit may import itself.
    """
    rows: list[tuple[list[str], str]] = []
    leaves: frozenset[str] = frozenset()
    in_table = False
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if [c.lower() for c in cells] == ["package", "may import"]:
            in_table = True  # the one table headed "| package | may import |"
            continue
        if not in_table:
            continue
        if not line.lstrip().startswith("|"):
            break
        if len(cells) != 2:
            continue
        names = re.findall(r"`([\w.]+)/?`", cells[0])
        if not names:
            continue
        if cells[0].lower().startswith("leaves"):
            leaves = frozenset(names)
        rows.append((names, cells[1]))
    rules: dict[str, frozenset[str] | None] = {}
    for names, allowed_text in rows:
        if allowed_text.lower().startswith(ANYTHING):
            allowed = None
        else:
            # Only the part before a colon lists units; the rest is prose that may name others
            # ("leaves only: it never imports `storage`").
            listing = allowed_text.split(":")[0]
            units = set(re.findall(r"`([\w.]+)/?`", listing))
            if re.search(r"\bleaves\b|\beach other\b", listing):
                units |= leaves
            allowed = frozenset(units)
        for name in names:
            rules[name] = allowed
    return rules, leaves


def _allowed(rules: dict[str, frozenset[str] | None], src: str, dst: str) -> bool:
    allowed = rules[src]
    return src == dst or allowed is None or dst in allowed


def layer_violations(imports: list[Import], rules: dict[str, frozenset[str] | None]) -> list[str]:
    """One line per import the table does not allow, or by a module the table does not place."""
    out: list[str] = []
    for imp in imports:
        src, dst = unit_of(imp.importer), unit_of(imp.target)
        if src not in rules:
            out.append(f"{imp.where()}: {imp.importer} is in no layer of docs/architecture.md "
                       f"(unit {src!r}); add it to the table")
            continue
        if dst not in rules:
            out.append(f"{imp.where()}: {imp.importer} imports {imp.target}, which is in no "
                       f"layer of docs/architecture.md (unit {dst!r})")
            continue
        if not _allowed(rules, src, dst):
            allowed = rules[src]
            listing = ", ".join(sorted(allowed or ())) or "nothing of ours"
            out.append(f"{imp.where()}: {imp.importer} imports {imp.target}: rule "
                       f"'{src} may import only {listing}'")
    return out


def named_rule_violations(imports: list[Import], leaves: frozenset[str]) -> dict[str, list[str]]:
    """The rules docs/architecture.md states on their own, each with the imports that break it."""
    rules = {
        "format/ never imports storage/ (it is pure: bytes in, typed objects out)":
            lambda s, d: s == "format" and d == "storage",
        "storage/ never imports format/ (it moves bytes and never interprets them)":
            lambda s, d: s == "storage" and d == "format",
        "cli/ imports nothing below ops/ other than the leaves":
            lambda s, d: s == "cli" and d not in leaves | {"cli", "ops"},
        "errors.py imports nothing of ours (every other module may import it)":
            lambda s, d: s == "errors" and d != "errors",
    }
    out: dict[str, list[str]] = {}
    for rule, breaks in rules.items():
        out[rule] = [f"{imp.where()}: {imp.importer} imports {imp.target}"
                     for imp in imports if breaks(unit_of(imp.importer), unit_of(imp.target))]
    return out


def subpackage_cycles(imports: list[Import]) -> list[str]:
    """Every cycle between units (subpackages and top-level modules), each with one import per
    edge that closes it. Found as the strongly connected components of the unit graph."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        src, dst = unit_of(imp.importer), unit_of(imp.target)
        if src != dst:
            edges.setdefault(src, {}).setdefault(dst, imp)
    nodes = sorted(set(edges) | {d for ds in edges.values() for d in ds})

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)

    out = []
    for comp in components:
        members = set(comp)
        lines = [f"cycle between {', '.join(comp)}:"]
        for src in comp:
            for dst, imp in sorted(edges.get(src, {}).items()):
                if dst in members:
                    lines.append(f"    {src} -> {dst}: {imp.where()} imports {imp.target}")
        out.append("\n".join(lines))
    return out


# --- the package as it is -------------------------------------------------------------------


def _modules() -> list[tuple[str, Path, bool]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append((".".join(parts), path, is_package))
    return out


def _all_imports() -> list[Import]:
    modules = _modules()
    known = {name for name, _, _ in modules}
    found: list[Import] = []
    for name, path, is_package in modules:
        found += imports_of(name, path.read_text(), str(path.relative_to(ROOT)), is_package, known)
    return found


def _rules() -> tuple[dict[str, frozenset[str] | None], frozenset[str]]:
    return parse_rules(ARCHITECTURE.read_text())


def _report(title: str, lines: list[str]) -> str:
    return f"{len(lines)} {title}:\n" + "\n".join(lines)


def test_the_table_in_docs_architecture_parses() -> None:
    rules, leaves = _rules()
    for unit in ("cli", "checkpointer", "ops", "save", "load", "layouts", "interop", "state",
                 "format", "storage", "errors"):
        assert unit in rules, f"docs/architecture.md's import table has no row for {unit!r}"
    assert "errors" in leaves, "docs/architecture.md's table names no leaves row"
    assert rules["format"] is not None and "storage" not in rules["format"]
    assert rules["cli"] is not None and "save" not in rules["cli"]


def test_the_diagram_in_docs_architecture_draws_the_table() -> None:
    rules, leaves = _rules()
    text = ARCHITECTURE.read_text()
    block = text.split("```mermaid", 1)[1].split("```", 1)[0]
    drawn = set()
    for line in block.splitlines():
        if "-->" in line:
            src, dsts = (part.strip() for part in line.split("-->"))
            drawn |= {(src, d.strip()) for d in dsts.split("&")}
    table = {(src, dst) for src, allowed in rules.items() if allowed is not None
             for dst in allowed if dst not in leaves and dst != src}
    assert drawn == table, f"drawn but not in the table: {sorted(drawn - table)}; " \
                           f"in the table but not drawn: {sorted(table - drawn)}"


def test_every_module_is_in_a_layer() -> None:
    rules, _ = _rules()
    missing = sorted({f"{path.relative_to(ROOT)} (unit {unit_of(name)!r})"
                      for name, path, _ in _modules() if unit_of(name) not in rules})
    assert not missing, _report("modules in no layer of docs/architecture.md's table", missing)


def test_every_import_is_allowed_by_the_table() -> None:
    rules, _ = _rules()
    bad = layer_violations(_all_imports(), rules)
    assert not bad, _report("imports the table in docs/architecture.md does not allow", bad)


@pytest.mark.parametrize("rule", list(named_rule_violations([], frozenset())))
def test_named_rule(rule: str) -> None:
    _, leaves = _rules()
    bad = named_rule_violations(_all_imports(), leaves)[rule]
    assert not bad, _report(f"imports break '{rule}'", bad)


def test_no_cycle_between_subpackages() -> None:
    cycles = subpackage_cycles(_all_imports())
    assert not cycles, _report("cycles between subpackages", cycles)


# --- the checker catches what it should (so a green run means something) -----------------------

_RULES = """
| package | may import |
|---|---|
| `cli` | `ops`, leaves (and `cli` itself) |
| `ops` | `format`, `storage`, leaves |
| `format` | leaves only: it never imports `storage` |
| `storage` | leaves only |
| leaves: `errors`, `settings` | each other |
| entry points: `__init__` | anything |
"""


def _check(sources: dict[str, str]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    known = set(sources)
    found: list[Import] = []
    for name, src in sources.items():
        is_package = name.endswith("__init__")
        module = name.removesuffix(".__init__")
        found += imports_of(module, src, name.replace(".", "/") + ".py", is_package,
                            known | {m.removesuffix(".__init__") for m in known})
    rules, leaves = parse_rules(_RULES)
    return layer_violations(found, rules), subpackage_cycles(found), \
        named_rule_violations(found, leaves)


def test_checker_parses_the_synthetic_table() -> None:
    rules, leaves = parse_rules(_RULES)
    assert leaves == {"errors", "settings"}
    assert rules["format"] == {"errors", "settings"}  # "storage" after the colon is prose
    assert rules["cli"] == {"ops", "cli", "errors", "settings"}
    assert rules["__init__"] is None


def test_checker_catches_an_import_hidden_in_a_function() -> None:
    bad, cycles, named = _check({
        "ckptctl.format.shard": "import os\n\ndef f():\n    from ckptctl.storage import base\n",
        "ckptctl.storage.base": "",
    })
    assert len(bad) == 1 and "ckptctl/format/shard.py:4" in bad[0] and "format may import" in bad[0]
    assert named["format/ never imports storage/ (it is pure: bytes in, typed objects out)"]
    assert not cycles


def test_checker_catches_type_checking_relative_and_dynamic_imports() -> None:
    bad, _, named = _check({
        "ckptctl.cli.verify": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from ..format import shard\n"          # line 3: relative, cli -> format
            "import importlib\n"
            "m = importlib.import_module('ckptctl.storage.base')\n"  # line 5: cli -> storage
            "from . import common\n"                    # line 6: cli -> cli, fine
            "from ckptctl.ops import verify\n"          # line 7: cli -> ops, fine
            "from ckptctl import errors\n"              # line 8: a leaf, fine
        ),
        "ckptctl.cli.common": "",
        "ckptctl.ops.verify": "",
        "ckptctl.format.shard": "",
        "ckptctl.storage.base": "",
        "ckptctl.errors": "",
    })
    assert sorted(b.split(":")[1] for b in bad) == ["3", "5"], bad
    assert len(named["cli/ imports nothing below ops/ other than the leaves"]) == 2


def test_checker_catches_a_cycle_and_storage_reading_format() -> None:
    bad, cycles, named = _check({
        "ckptctl.storage.__init__": "def f():\n    import ckptctl.format.marker\n",
        "ckptctl.format.marker": "from ckptctl.storage import open_storage\n",
    })
    assert len(bad) == 2
    assert len(cycles) == 1 and "format, storage" in cycles[0], cycles
    assert "ckptctl/storage/__init__.py:2" in cycles[0] and "ckptctl/format/marker.py:1" in cycles[0]
    assert named["storage/ never imports format/ (it moves bytes and never interprets them)"]


def test_checker_catches_a_module_in_no_layer_and_the_package_root() -> None:
    bad, _, _ = _check({
        "ckptctl.ops.verify": "from ckptctl import Checkpointer\nimport ckptctl.extra.thing\n",
        "ckptctl.extra.thing": "",
        "ckptctl.__init__": "from ckptctl.ops import verify\n",  # an entry point: anything
    })
    assert len(bad) == 2, bad
    assert "ops may import only" in bad[0] and "ckptctl/ops/verify.py:1" in bad[0]
    assert "in no layer" in bad[1] and "'extra'" in bad[1]


def test_checker_passes_a_clean_package() -> None:
    bad, cycles, named = _check({
        "ckptctl.cli.verify": "from ckptctl.ops import verify\nfrom ckptctl.errors import E\n",
        "ckptctl.ops.verify": "from ckptctl.format import shard\nfrom ckptctl.storage import b\n",
        "ckptctl.format.shard": "from ckptctl.errors import E\n",
        "ckptctl.storage.__init__": "from ckptctl import settings\n",
        "ckptctl.settings": "from ckptctl.errors import E\n",
        "ckptctl.errors": "",
    })
    assert bad == [] and cycles == [] and not any(named.values())
