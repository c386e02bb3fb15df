"""The package's shape, kept true: no import cycle (``TYPE_CHECKING`` imports included), no
module past the size guideline, nothing at the root but the entry points and the ground floor.
(Which floor may import which is ``make lint``'s import-linter contracts.)"""

from __future__ import annotations

import graphlib

import grimp

from tests.helpers.paths import REPO

PROXY = REPO / "proxy"
MAX_LINES = 350
ROOT_MODULES = {"__init__.py", "ticket.py", "tasks.py", "signals.py"}


def _cycle(graph: grimp.ImportGraph) -> list[str]:
    """One import cycle, as graphlib reports it (first module repeated last), or [] if none."""
    sorter = graphlib.TopologicalSorter(
        {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    )
    try:
        sorter.prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_no_import_cycle_type_checking_included() -> None:
    graph = grimp.build_graph("proxy", exclude_type_checking_imports=False)
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "b", "c"):
        graph.add_module(name)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="a")
    graph.add_import(importer="c", imported="a")
    cycle = _cycle(graph)
    assert cycle[0] == cycle[-1]
    assert sorted(set(cycle)) == ["a", "b"]


def test_no_module_past_the_size_guideline() -> None:
    long = {
        str(p.relative_to(PROXY)): n
        for p in PROXY.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_root_holds_only_entry_points_and_the_ground_floor() -> None:
    assert {p.name for p in PROXY.glob("*.py")} == ROOT_MODULES
