"""Every ``from ckptctl... import name`` in the package names something that exists.

Imports inside functions (the lazy ones that keep the CLI's start-up free of torch) run only
when their code path does, so a name moved or deleted by a refactor breaks one verb at run
time while every test that does not reach that path stays green. This test resolves all of
them statically: parse each module, import the module named, look the name up.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptctl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for every ``from ckptctl... import name``, relative ones
    resolved against the importing module's package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module != "ckptctl" and not module.startswith("ckptctl."):
                continue
            for alias in node.names:
                if alias.name != "*":
                    found.append((str(path.relative_to(PACKAGE.parent)), node.lineno, module, alias.name))
    return found


def _resolves(module: str, name: str) -> bool:
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return True
    try:  # ``from package import submodule`` names a module, not an attribute yet
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return False
    return True


def test_the_scan_finds_function_level_imports():
    # The point of the test is the imports inside functions: prove the scan sees them.
    lazy = [imp for imp in _from_imports() if imp[0] == "ckptctl/__init__.py"]
    assert lazy, "ckptctl/__init__.py imports Checkpointer lazily; the scan must see that import"


def test_an_import_of_a_missing_name_is_caught():
    assert not _resolves("ckptctl.errors", "NoSuchErrorClass")
    assert _resolves("ckptctl.errors", "InvalidCheckpoint")
    assert _resolves("ckptctl", "errors")


def test_every_import_from_ckptctl_resolves():
    broken = [f"{where}:{line}: `from {module} import {name}`"
              for where, line, module, name in _from_imports() if not _resolves(module, name)]
    assert not broken, "names that do not exist:\n" + "\n".join(broken)
