"""The package's shape, kept true: no import cycle (``TYPE_CHECKING`` imports included), no
module past the size guideline, nothing at the root but the entry points and the ground floor.
(Which floor may import which is ``make lint``'s import-linter contracts.)"""

from __future__ import annotations

import grimp

from tests.helpers.paths import REPO

PROXY = REPO / "proxy"
MAX_LINES = 400
ROOT_MODULES = {"__init__.py", "ticket.py", "tasks.py"}


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
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
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_no_import_cycle_type_checking_included() -> None:
    graph = grimp.build_graph("proxy", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "b", "c"):
        graph.add_module(name)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="a")
    graph.add_import(importer="c", imported="a")
    assert _cycles(graph) == [["a", "b"]]


def test_no_module_past_the_size_guideline() -> None:
    long = {
        str(p.relative_to(PROXY)): n
        for p in PROXY.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_root_holds_only_entry_points_and_the_ground_floor() -> None:
    assert {p.name for p in PROXY.glob("*.py")} == ROOT_MODULES
