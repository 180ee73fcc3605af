"""The layer rules of docs/architecture.md, checked on the source.

Every module under ``ckptctl/`` is parsed with ``ast`` (nothing is imported, so this runs in well
under a second and without torch). Every import counts: top-level ones, those inside functions,
under ``if TYPE_CHECKING``, in ``try`` blocks, relative ones (resolved), and
``importlib.import_module("ckptctl...")`` calls with a literal name. A lazy import is still a
dependency; it only hides it.

The allowed imports are read from the table in docs/architecture.md, so the page and the test
cannot drift apart: change the table and the test follows. Each failure names the module, the
line and the rule, and every violation is reported at once.

Inside a package, modules form no cycle either; no two packages import each other (inside
``ops`` each package counts: ``ops.verify``, ``ops.seal``...); and the table holds no entry that
no import uses. Outside ``layouts/`` no module branches on a layout's name or type, nor on who
wrote a checkpoint: the names that told ckptctl's own format apart (``verified_by_manifest``,
``written_by_ckptctl``, ``NATIVE``, ``NATIVE_NAME``, ``StackLayout``) appear nowhere else but in
the copy engines' files named below, until they ask the ``Layout`` protocol too (the list may
only shrink). The checkers live in ``arch_imports.py`` and ``arch_layout_names.py``; the
self-tests at the end prove each one catches what it should.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from arch_imports import (
    Import,
    imports_of,
    layer_violations,
    module_cycles,
    named_rule_violations,
    nested_units,
    package_cycles,
    parse_rules,
    subpackage_cycles,
    table_entries,
    unit_of,
    unused_entries,
)
from arch_layout_names import FLAGS, Offence, flag_uses, layout_names, offences

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptctl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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


def test_no_cycle_between_modules_of_a_package() -> None:
    cycles = module_cycles(_all_imports())
    assert not cycles, _report("cycles between modules of one package (move the shared piece to the "
                               "module that owns its concept; an import inside a function still counts)", cycles)


def test_no_two_packages_import_each_other() -> None:
    cycles = package_cycles(_all_imports(), nested_units([name for name, _, _ in _modules()]))
    assert not cycles, _report("cycles between packages (what two packages both need moves below them)", cycles)


def test_every_entry_of_the_table_is_used() -> None:
    unused = unused_entries(_all_imports(), table_entries(ARCHITECTURE.read_text()))
    assert not unused, _report("entries of the import table that no module uses", unused)


# Every function outside layouts/ that branches on a layout's name or type today. Each is a piece
# of a layout's behaviour living outside its class; the Layout refactor moves them into the
# layouts and deletes them here. The list may only shrink: a new offender fails, and so does an
# entry that no longer offends (remove it, so nothing can come back under its cover).
LAYOUT_NAME_OFFENDERS: frozenset[str] = frozenset()


def _layout_name_offences() -> list[Offence]:
    """Every layout-name comparison or layout-type check in a module outside layouts/."""
    names = layout_names({str(p): p.read_text() for p in (PACKAGE / "layouts").rglob("*.py")})
    found: list[Offence] = []
    for name, path, is_package in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[1] != "layouts":
            found += offences(name, path.read_text(), str(rel), is_package, names)
    return found


def test_no_new_layout_name_comparison_outside_layouts() -> None:
    found = _layout_name_offences()
    new = [str(o) for o in found if o.key not in LAYOUT_NAME_OFFENDERS]
    assert not new, _report("comparisons of layout names or types outside layouts/ (ask the Layout "
                            "instead: what a layout does differently belongs to its class)", new)


def _functions() -> set[str]:
    """Every ``path:qualified.name`` of a function or class defined under ckptctl/."""
    found: set[str] = set()
    for _, path, _ in _modules():
        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(f"{path.relative_to(ROOT)}:{prefix}{child.name}")
                    walk(child, f"{prefix}{child.name}.")
                else:
                    walk(child, prefix)
        walk(ast.parse(path.read_text()), "")
    return found


def test_the_layout_name_allow_list_has_no_stale_entry() -> None:
    # A function still there that no longer offends was fixed: its entry goes, so nothing comes
    # back under its cover. (One not there at all is not judged: five people change this tree at
    # once, and a function another change adds or removes may reach HEAD after this list.)
    stale = sorted((LAYOUT_NAME_OFFENDERS & _functions()) - {o.key for o in _layout_name_offences()})
    assert not stale, _report("entries of LAYOUT_NAME_OFFENDERS that no longer offend: remove them", stale)


# The files outside layouts/ that may still tell ckptctl's own format apart by one of FLAGS: the
# copy engines, until their rewrite asks the Layout protocol (issue 28, the copy side). Only
# files under MAY_BE_TRANSITIONAL may be listed, and the list may only shrink: a listed file that
# exists and no longer uses one fails, so nothing comes back under its cover.
TRANSITIONAL_FLAG_USERS: frozenset[str] = frozenset()
MAY_BE_TRANSITIONAL = ("ckptctl/ops/transfer/", "ckptctl/tiers/upload.py")


def _flag_uses() -> list[Offence]:
    found: list[Offence] = []
    for _, path, _ in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[1] != "layouts":
            found += flag_uses(path.read_text(), str(rel))
    return found


def test_nothing_outside_layouts_tells_ckptctls_own_format_apart() -> None:
    new = [str(o) for o in _flag_uses() if o.path not in TRANSITIONAL_FLAG_USERS]
    assert not new, _report(f"uses of {', '.join(sorted(FLAGS))} outside layouts/ (ask the Layout protocol: "
                            "ckptctl's own format is one layout among the others)", new)


def test_the_transitional_flag_users_are_copy_engines_that_still_use_them() -> None:
    assert all(p.startswith(MAY_BE_TRANSITIONAL) for p in TRANSITIONAL_FLAG_USERS), TRANSITIONAL_FLAG_USERS
    users = {o.path for o in _flag_uses()}
    stale = sorted(p for p in TRANSITIONAL_FLAG_USERS if (ROOT / p).exists() and p not in users)
    assert not stale, _report("entries of TRANSITIONAL_FLAG_USERS that no longer use a flag: remove them", stale)


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


def _imports(sources: dict[str, str]) -> list[Import]:
    """Every import of a synthetic package, given as ``{module or package.__init__: source}``."""
    known = set(sources)
    found: list[Import] = []
    for name, src in sources.items():
        is_package = name.endswith("__init__")
        module = name.removesuffix(".__init__")
        found += imports_of(module, src, name.replace(".", "/") + ".py", is_package,
                            known | {m.removesuffix(".__init__") for m in known})
    return found


def _check(sources: dict[str, str]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    found = _imports(sources)
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


def test_checker_catches_a_cycle_between_modules_of_one_package() -> None:
    found = _imports({
        # verify <-> layout_verify, the second edge hidden in a function; an __init__ in a
        # three-module cycle with a TYPE_CHECKING import; a relative import closing a third.
        "ckptctl.ops.verify": "def f():\n    from ckptctl.ops.layout_verify import g\n",
        "ckptctl.ops.layout_verify": "from ckptctl.ops.verify import Level\n",
        "ckptctl.storage.__init__": "from ckptctl.storage.s3 import S3Storage\n",
        "ckptctl.storage.s3": "from ckptctl.storage.s3_transfer import S3Writer\n",
        "ckptctl.storage.s3_transfer": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from ckptctl.storage import Storage\n"),
        "ckptctl.load.a": "from . import b\n",
        "ckptctl.load.b": "import importlib\nimportlib.import_module('ckptctl.load.a')\n",
        # no cycle: a chain inside a package, and a cycle across packages (subpackage_cycles')
        "ckptctl.format.x": "from ckptctl.format.y import Y\nfrom ckptctl.state.z import Z\n",
        "ckptctl.format.y": "",
        "ckptctl.state.z": "from ckptctl.format.x import X\n",
    })
    cycles = module_cycles(found)
    assert len(cycles) == 3, cycles
    ops, storage, load = sorted(cycles, key=lambda c: ("ops" not in c, "storage" not in c))
    assert "ckptctl.ops.layout_verify, ckptctl.ops.verify" in ops and "ckptctl/ops/verify.py:2" in ops
    assert "ckptctl.storage, ckptctl.storage.s3, ckptctl.storage.s3_transfer" in storage
    assert "ckptctl/storage/s3_transfer.py:3" in storage
    assert "ckptctl/load/b.py:2" in load and "ckptctl/load/a.py:1" in load
    assert module_cycles([i for i in found if i.importer.startswith("ckptctl.format")]) == []


def test_checker_names_an_unused_entry_of_the_table() -> None:
    entries = table_entries(_RULES)
    assert [str(e) for e in entries] == ["'cli may import `ops`'", "'cli may import leaves'",
                                         "'ops may import `format`'", "'ops may import `storage`'",
                                         "'ops may import leaves'", "'format may import leaves'",
                                         "'storage may import leaves'", "'errors, settings may import each other'"]
    found = _imports({
        "ckptctl.cli.verify": "from ckptctl.ops import verify\nfrom ckptctl.errors import E\n",
        "ckptctl.ops.verify": "def f():\n    from ckptctl.format import shard\n",  # a lazy use counts
        "ckptctl.format.shard": "from ckptctl.settings import S\n",
        "ckptctl.settings": "from ckptctl.errors import E\n",
        "ckptctl.errors": "",
    })
    unused = unused_entries(found, entries)
    assert len(unused) == 3, unused
    assert "'ops may import `storage`'" in unused[0] and "'ops may import leaves'" in unused[1]
    assert "'storage may import leaves'" in unused[2]


def test_checker_finds_layout_name_comparisons_and_type_checks() -> None:
    names = layout_names({
        "native.py": 'NAME = "ckptctl"\n',
        "megatron.py": 'class MegatronLayout:\n    name = "megatron"\n',
        "base.py": 'class Layout:\n    name = "?"\n',  # a placeholder is no name
    })
    assert names == {"ckptctl", "megatron"}
    source = (
        "from ckptctl.layouts.native import NAME as NATIVE_NAME\n"
        "from ..layouts.stack import StackLayout\n"
        "def verify_entry(entry):\n"
        "    if entry.layout == NATIVE_NAME:\n"                    # 4: an imported constant
        "        return 1\n"
        "class Plan:\n"
        "    def pick(self, layout, fmt, t):\n"
        "        a = isinstance(layout, (int, StackLayout))\n"     # 8: a layout type
        "        b = fmt in ('megatron', 'x')\n"                   # 9: a stack-only name
        "        c = layout.name == 'ckptctl'\n"                   # 10: a layout's name
        "        d = fmt == 'ckptctl'\n"                           # file formats: fine
        "        e = t.layout != torch.strided\n"                  # a tensor's layout: fine
        "        return type(layout) is DcpLayout\n"               # 13: a layout class
        "from ckptctl.layouts.safe_load import STRUCTURAL_MARK\n"
        "def g(entry):\n"
        "    return STRUCTURAL_MARK in entry\n"                    # a constant naming no layout: fine
    )
    found = offences("ckptctl.ops.verify", source, "ckptctl/ops/verify.py", False, names)
    assert [(o.key, o.line) for o in found] == [
        ("ckptctl/ops/verify.py:verify_entry", 4), ("ckptctl/ops/verify.py:Plan.pick", 8),
        ("ckptctl/ops/verify.py:Plan.pick", 9), ("ckptctl/ops/verify.py:Plan.pick", 10),
        ("ckptctl/ops/verify.py:Plan.pick", 13)], [str(o) for o in found]


# --- inside ops: each sub-package's docstring says what it may import, and that holds ----------

LEAF_MODULES = ("ckptctl.errors", "ckptctl.settings", "ckptctl.durations", "ckptctl.progress",
                "ckptctl.version", "ckptctl.plugins")


def _may_import(docstring: str) -> list[str]:
    """The ``names`` of a sub-package docstring's "May import:" sentence, as dotted prefixes
    under ``ckptctl`` (``format`` -> ``ckptctl.format``, ``ops.seal.check`` -> itself)."""
    text = docstring.split("May import:", 1)[1].split("never", 1)[0]
    return [f"ckptctl.{name}" for name in re.findall(r"``([a-z_.]+)``", text)]


def test_each_ops_subpackage_imports_only_what_its_docstring_says() -> None:
    imports = _all_imports()
    checked = 0
    for init in sorted((PACKAGE / "ops").glob("*/__init__.py")):
        package = f"ckptctl.ops.{init.parent.name}"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in doc, f"{init.relative_to(ROOT)}: its docstring says nothing of what it may import"
        allowed = (package, *LEAF_MODULES, *_may_import(doc))
        bad = [f"{i.where()}: {i.target}" for i in imports if i.importer.startswith(package + ".") or i.importer == package
               if not any(i.target == a or i.target.startswith(a + ".") for a in allowed)]
        assert not bad, _report(f"imports {package}'s docstring does not allow", bad)
        checked += 1
    assert checked >= 5  # verify, retention, transfer, transform, seal


def test_checker_catches_two_packages_importing_each_other() -> None:
    found = _imports({
        # ops.verify <-> ops.seal through a function-level import; ops.retention -> ops.lock is one way
        "ckptctl.ops.verify.layouts": "def f():\n    from ckptctl.ops.seal.check import g\n",
        "ckptctl.ops.seal.sealing": "from ckptctl.ops.verify.layouts import f\n",
        "ckptctl.ops.seal.check": "",
        "ckptctl.ops.retention.plan": "from ckptctl.ops.lock import RootLock\n",
        "ckptctl.ops.lock": "from ckptctl.errors import E\n",
        "ckptctl.ops.rm": "from ckptctl.ops.retention.plan import plan\n",
        "ckptctl.errors": "",
    })
    nested = nested_units([i.importer for i in found] + [i.target for i in found])
    assert nested == {"ops"}
    (cycle,) = package_cycles(found, nested)
    assert "ops.seal, ops.verify" in cycle and "ckptctl/ops/verify/layouts.py:2" in cycle, cycle
    assert subpackage_cycles(found) == [] and module_cycles(found) == []  # what the older checks missed


def test_checker_finds_every_use_of_a_flag() -> None:
    source = (
        "from ckptctl.layouts.catalog import NATIVE, list_checkpoints\n"      # 1: imported
        "from ckptctl.layouts.stack import StackLayout as Base\n"             # 2: imported, renamed
        "def verify(found, layout):\n"
        "    if found.verified_by_manifest:\n"                               # 4: an attribute
        "        return list_checkpoints(layouts=NATIVE)\n"                  # 5: a name
        "    return layout.written_by_ckptctl\n"                             # 6: an attribute
        "NATIVE_NAME = 'ckptctl'\n"                                          # 7: a name
        "def fine(layout):\n"
        "    return layout.check(layout.root)\n"                             # the protocol: fine
    )
    found = flag_uses(source, "ckptctl/ops/x.py")
    assert sorted({o.line for o in found}) == [1, 2, 4, 5, 6, 7], [str(o) for o in found]
    assert {o.key for o in found if o.line in (4, 5, 6)} == {"ckptctl/ops/x.py:verify"}
