"""No module of phalanx imports another module's private names (``_name``).

A private name is its module's to change; a second module that imports it makes that change break code
the author did not look at. Ruff's PLC2701 checks this only for other packages (it lets every module of
the same top-level package through), so this test checks phalanx's own modules: ``from phalanx.x import
_name``, and ``_name`` read off an imported phalanx module (``import phalanx.x as m; m._name``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """Every import of another phalanx module's private name in the file at ``path``, as ``line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> the phalanx module it is bound to
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "phalanx":
                    modules[alias.asname or "phalanx"] = alias.name if alias.asname else "phalanx"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "phalanx":
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = [f"{path.relative_to(SRC)}:{hit}" for path in sorted(SRC.rglob("*.py")) for hit in private_imports(path)]
    assert not found, (
        "These modules import private names of other modules. Make the name public (drop the underscore, give it "
        "a docstring) or move the code that needs it next to it:\n" + "\n".join(found)
    )


def test_the_check_sees_both_forms(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import phalanx.checkpoint.format as fmt\nfrom phalanx.trainer.data import _hidden\n"
                     "from phalanx.checkpoint import format\n\nfmt._refused_global\nformat._x\nfmt.read_file\n")
    assert private_imports(probe) == ["2: from phalanx.trainer.data import _hidden",
                                      "5: phalanx.checkpoint.format._refused_global",
                                      "6: phalanx.checkpoint.format._x"]
