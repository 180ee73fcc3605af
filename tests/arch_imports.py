"""The import checker behind tests/test_architecture.py: collecting every import of a ckptctl
module from its source, reading the import table of docs/architecture.md, and judging imports
against it (layers, named rules, cycles between packages and between modules of one package,
table entries nobody uses).

Pure functions of source text and markdown: nothing is imported from ckptctl, so the self-tests
feed them synthetic packages and the real run needs no torch.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Entry:
    """One permission of the import table: the units of a row (``sources``) may import
    ``targets``. A unit named in the second cell is one entry; the word ``leaves`` (or
    ``each other``) is one entry for all leaf units together."""

    sources: tuple[str, ...]
    targets: frozenset[str]
    label: str  # as the table writes it: "`ops`" or "leaves"

    def __str__(self) -> str:
        return f"'{', '.join(self.sources)} may import {self.label}'"


def _table_rows(markdown: str) -> tuple[list[tuple[list[str], str]], frozenset[str]]:
    """The rows of the one table headed ``| package | may import |`` as (unit names, second
    cell), and the leaf units (the row whose first cell starts with "leaves")."""
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
    return rows, leaves


def _listing(allowed_text: str) -> tuple[list[str], str | None]:
    """The units a second cell names, in order, and the group word it uses ("leaves", "each
    other") if any. Only the part before a colon lists units; the rest is prose that may name
    others ("leaves only: it never imports `storage`")."""
    listing = allowed_text.split(":")[0]
    group = re.search(r"\bleaves\b|\beach other\b", listing)
    return list(dict.fromkeys(re.findall(r"`([\w.]+)/?`", listing))), group.group(0) if group else None


def parse_rules(markdown: str) -> tuple[dict[str, frozenset[str] | None], frozenset[str]]:
    """The import table of docs/architecture.md as ``{unit: allowed units}`` (``None`` for
    "anything"), and the set of leaf units.

    Only the table headed ``| package | may import |`` counts. A row's first cell holds the
    unit names in backticks (one row may name several, like the leaves); the second holds the
    units it may import in backticks, the word ``leaves`` for all leaf units, or ``anything``.
    Every unit may import itself.
    """
    rows, leaves = _table_rows(markdown)
    rules: dict[str, frozenset[str] | None] = {}
    for names, allowed_text in rows:
        allowed: frozenset[str] | None = None
        if not allowed_text.lower().startswith(ANYTHING):
            units, group = _listing(allowed_text)
            allowed = frozenset(units) | (leaves if group else frozenset())
        for name in names:
            rules[name] = allowed
    return rules, leaves


def table_entries(markdown: str) -> list[Entry]:
    """Every permission the table grants, one ``Entry`` each. Rows of ``anything`` grant none
    (entry points sit above every layer), nor does a unit naming itself (always allowed)."""
    rows, leaves = _table_rows(markdown)
    entries: list[Entry] = []
    for names, allowed_text in rows:
        if allowed_text.lower().startswith(ANYTHING):
            continue
        units, group = _listing(allowed_text)
        entries += [Entry(tuple(names), frozenset({u}), f"`{u}`") for u in units if u not in names]
        if group:
            entries.append(Entry(tuple(names), leaves, group))
    return entries


def unused_entries(imports: list[Import], entries: list[Entry]) -> list[str]:
    """One line per table entry that no import uses: an allowed edge nobody needs is a rule
    that only widens what the next change may do unnoticed. Remove it from the table, or use
    it."""
    used = {(unit_of(imp.importer), unit_of(imp.target)) for imp in imports}
    return [f"docs/architecture.md: the table allows {entry}, and no module uses it; "
            "remove it from the table (and the diagram)"
            for entry in entries
            if not any((src, dst) in used for src in entry.sources for dst in entry.targets if dst != src)]


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


def _cycles(edges: dict[str, dict[str, Import]], what: str) -> list[str]:
    """Every cycle of the graph ``edges`` (``{node: {node it imports: one import doing it}}``),
    each with one import per edge inside it that closes it. Found as the strongly connected
    components of the graph (Tarjan), so a cycle through many nodes is reported once, whole."""
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
        lines = [f"cycle between {what} {', '.join(comp)}:"]
        for src in comp:
            for dst, imp in sorted(edges.get(src, {}).items()):
                if dst in members:
                    lines.append(f"    {src} -> {dst}: {imp.where()} imports {imp.target}")
        out.append("\n".join(lines))
    return out


def subpackage_cycles(imports: list[Import]) -> list[str]:
    """Every cycle between units (subpackages and top-level modules), each with one import per
    edge that closes it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        src, dst = unit_of(imp.importer), unit_of(imp.target)
        if src != dst:
            edges.setdefault(src, {}).setdefault(dst, imp)
    return _cycles(edges, "units")


def module_cycles(imports: list[Import]) -> list[str]:
    """Every cycle between modules of one unit (``ops.verify.checkpoint`` -> ``ops.verify.layouts`` ->
    ``ops.verify.checkpoint``), a package's ``__init__`` included. Every import form counts, those in
    functions and under TYPE_CHECKING too: a cycle hidden in a function is still two modules
    that cannot be understood, tested or moved one without the other. Cycles across units are
    ``subpackage_cycles``' to report (they are cycles between units first)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.importer != imp.target and unit_of(imp.importer) == unit_of(imp.target):
            edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    return _cycles(edges, "modules")


def nested_units(modules: list[str]) -> frozenset[str]:
    """The units whose modules live in packages of their own (``ops``: ``ops.verify``,
    ``ops.retention``...), read from the dotted names of every module."""
    return frozenset(m.split(".")[1] for m in modules if len(m.split(".")) >= 4)


def package_of(module: str, nested: frozenset[str]) -> str:
    """The package a module belongs to for the rule that no two packages import each other: in
    a unit with packages of its own, each of them, and each module beside them
    (``ckptctl.ops.verify.engine`` -> ``ops.verify``, ``ckptctl.ops.rm`` -> ``ops.rm``);
    elsewhere the unit (``ckptctl.layouts.catalog`` -> ``layouts``)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in nested:
        return ".".join(parts[1:3])
    return unit_of(module)


def package_cycles(imports: list[Import], nested: frozenset[str]) -> list[str]:
    """Every cycle between packages (two that import each other, or a longer ring), each with
    one import per edge that closes it. Inside ``ops`` each package counts on its own: a verb's
    package importing another that imports it back cannot be read or moved one without the
    other, whatever the layer table allows (what both need belongs below both)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        src, dst = package_of(imp.importer, nested), package_of(imp.target, nested)
        if src != dst:
            edges.setdefault(src, {}).setdefault(dst, imp)
    return _cycles(edges, "packages")
