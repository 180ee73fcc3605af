"""The rule "no module outside ``layouts/`` compares layout names or types", checked on the source.

A branch on which layout a checkpoint is (``entry.layout == NATIVE_NAME``, ``isinstance(layout,
StackLayout)``, ``fmt == "megatron"``) puts a piece of that layout's behaviour outside its class,
where the next layout added is forgotten. What a layout does differently belongs to the layout
(``layouts/``), asked through the ``Layout`` interface.

Found with ``ast`` (nothing imported), in every module outside ``ckptctl/layouts/``:

- a comparison (``==``, ``!=``, ``is``, ``in``, ...) one of whose sides is a constant of
  ``ckptctl.layouts`` that names layouts (``NAME`` as ``NATIVE_NAME``, ``UNKNOWN``, ``FORMATS``,
  ``NATIVE``, ``LAYOUTS``), a layout class, a
  ``.layout`` attribute (a catalog entry's or a seal's layout name), a layout's ``.name``
  (``layout.name``), or a string that is a layout's name and that only a layout
  uses (``"hf-trainer"``, ``"megatron"``, ``"deepspeed"``, ``"lightning"``; ``"ckptctl"`` and
  ``"dcp"`` are also file formats of ``convert``, so they count only beside a layout name);
- ``isinstance``/``issubclass`` against a layout class (a name ending in ``Layout``, or a
  layout class imported from ``ckptctl.layouts`` under another name).

Each offence is named by file and enclosing function (``ckptctl/ops/verify/checkpoint.py:verify_root``),
the unit a later change removes.

``flag_uses`` finds the other way to branch on who wrote a checkpoint: the names that told
ckptctl's own format apart from the others' before every verb asked the ``Layout`` protocol
(``FLAGS``: the booleans ``verified_by_manifest`` and ``written_by_ckptctl``, the constants
``NATIVE`` and ``NATIVE_NAME``, the class ``StackLayout``), wherever they appear: as a name, an
attribute, or imported.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from arch_imports import _resolve_from

# Names a layout and a file format share: a comparison with them alone is about file formats.
SHARED_WITH_FILE_FORMATS = frozenset({"ckptctl", "dcp"})
# The constants of ``ckptctl.layouts`` that name layouts or list them (native.NAME, base.UNKNOWN,
# catalog.FORMATS / NATIVE / LAYOUTS); other constants there (file names, marks) are no layout.
LAYOUT_CONSTANTS = frozenset({"NAME", "UNKNOWN", "FORMATS", "NATIVE", "LAYOUTS"})


@dataclass(frozen=True)
class Offence:
    path: str
    function: str  # qualified name of the enclosing function, "<module>" at the top level
    line: int
    what: str

    @property
    def key(self) -> str:
        return f"{self.path}:{self.function}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.function}): {self.what}"


def layout_names(layout_sources: dict[str, str]) -> frozenset[str]:
    """The names layouts give themselves: ``name = "..."`` in a class body and ``NAME = "..."``
    at a module's top, in the sources of ``ckptctl/layouts/``."""
    found: set[str] = set()
    for source in layout_sources.values():
        tree = ast.parse(source)
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for node in body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    named = any(isinstance(t, ast.Name) and t.id in ("name", "NAME") for t in targets)
                    if named and re.fullmatch(r"[a-z][a-z0-9-]*", node.value.value):  # not a placeholder ("?")
                        found.add(node.value.value)
    return frozenset(found)


def _from_layouts(tree: ast.AST, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """Local names bound to layout-naming constants and to layout classes imported from
    ``ckptctl.layouts``."""
    constants: set[str] = set()
    classes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package) or ""
            if base == "ckptctl.layouts" or base.startswith("ckptctl.layouts."):
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name in LAYOUT_CONSTANTS:
                        constants.add(local)
                    elif alias.name.endswith("Layout"):  # a layout class, perhaps renamed on import
                        classes.add(local)
    return constants, classes


def _strings(node: ast.expr) -> list[str]:
    """The string constants ``node`` is or holds (a tuple, list or set display of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _is_layout_class(node: ast.expr, classes: set[str]) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in classes or name.endswith("Layout")


def _layout_side(node: ast.expr, constants: set[str], classes: set[str]) -> str | None:
    """What makes one side of a comparison a layout name or type, or None."""
    if isinstance(node, ast.Name) and node.id in constants:
        return node.id
    if _is_layout_class(node, classes) and isinstance(node, (ast.Name, ast.Attribute)):
        return ast.unparse(node)
    if isinstance(node, ast.Attribute) and node.attr == "layout":
        return ast.unparse(node)
    if isinstance(node, ast.Attribute) and node.attr == "name" and "layout" in ast.unparse(node.value).lower():
        return ast.unparse(node)
    return None


def offences(module: str, source: str, path: str, is_package: bool, names: frozenset[str]) -> list[Offence]:
    """Every layout-name comparison and layout-type check in one module's source."""
    tree = ast.parse(source, filename=path)
    constants, classes = _from_layouts(tree, module, is_package)
    stack_only = names - SHARED_WITH_FILE_FORMATS
    found: list[Offence] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = node.name if where == "<module>" else f"{where}.{node.name}"
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            # A tensor's layout (``t.layout != torch.strided``) is torch's word, not ours.
            tensor_layout = any(ast.unparse(s).startswith("torch.") for s in sides)
            marks = [m for m in (_layout_side(s, constants, classes) for s in sides) if m]
            strings = [s for side in sides for s in _strings(side)]
            if stack_only & set(strings):
                marks.append(repr(sorted(stack_only & set(strings))[0]))
            elif marks and names & set(strings):
                marks.append(repr(sorted(names & set(strings))[0]))
            if marks and not tensor_layout:
                found.append(Offence(path, where, node.lineno, f"compares {', '.join(marks)}: {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(_is_layout_class(k, classes) for k in kinds):
                found.append(Offence(path, where, node.lineno, f"checks a layout type: {ast.unparse(node)}"))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found


# Names that tell ckptctl's own format apart from other tools' outside ``layouts/``.
FLAGS = frozenset({"verified_by_manifest", "written_by_ckptctl", "NATIVE", "NATIVE_NAME", "StackLayout"})


def flag_uses(source: str, path: str) -> list[Offence]:
    """Every use of a name of ``FLAGS`` in one module's source: a name, an attribute, or an
    import (under its own name or another)."""
    tree = ast.parse(source, filename=path)
    found: list[Offence] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = node.name if where == "<module>" else f"{where}.{node.name}"
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names = [n for alias in node.names for n in (alias.name.rsplit(".", 1)[-1], alias.asname) if n]
        for name in sorted(set(names) & FLAGS):
            found.append(Offence(path, where, getattr(node, "lineno", 0), f"uses {name}"))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found
