"""No import circle anywhere in phalanx, between any two modules.

import-linter's contracts (pyproject.toml) keep the layers and forbid cycles between the siblings of each
package; a circle can still run through a package's ``__init__`` and modules of other packages (a facade
that re-exports a layer above it). This test builds the whole module graph with grimp, the library
import-linter uses, counting imports inside functions and under ``TYPE_CHECKING``, and asserts that its
strongly connected components are single modules.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_phalanx_has_no_import_circle() -> None:
    found = circles(grimp.build_graph("phalanx", include_external_packages=False))
    assert not found, "Import circles (each line: the modules of one circle):\n" + "\n".join(map(str, found))


def test_the_check_finds_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")
    (package / "b.py").write_text("def f():\n    from circled import c\n")
    (package / "c.py").write_text("import circled.a\n")
    (package / "d.py").write_text("import circled.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert circles(grimp.build_graph("circled", cache_dir=None)) == [["circled.a", "circled.b", "circled.c"]]
