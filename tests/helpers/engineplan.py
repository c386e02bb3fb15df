"""The order the suite runs in: each vLLM engine it needs started once, while tests that need
none run.

A start costs ~25 s of the engine cores (one core on a 2-core machine) and ~3 GB; a few engines
fit at once. The modules that use engines are packed into *waves*: settings used together (one
module needing two engines, or a setting shared by modules) stay in one wave, and a wave holds
at most ``capacity`` settings. The modules that need no engine are cut into as many *fillers*,
each sized by the starts of the wave after it. The run is filler 1, wave 1, filler 2, wave 2...:
a wave's engines start during the filler before it, and the farm stops each engine after the
last test that uses it. Modules stay whole (module fixtures set up once); in a wave those using
fewer settings go first, so that the first waits for one start and the others start beside it;
a group of settings larger than ``capacity`` still runs, with an engine started again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", bound=Hashable)


@dataclass(frozen=True)
class Wave(Generic[S]):
    settings: frozenset[S]
    units: tuple[int, ...]  # indices of the modules it runs, in collection order


def waves(
    needs: Sequence[frozenset[S]],
    capacity: int,
    quiet: Sequence[bool] = (),
    restarts: Sequence[bool] = (),
) -> list[Wave[S]]:
    """The modules with needs, packed: groups of settings used together (connected through
    shared modules), first-fit decreasing into waves of at most ``capacity`` settings. In a
    wave, the modules that use fewer settings run first (the first waits for one start, the
    others start beside it), the quiet ones (``quiet[i]``: nothing may start beside module i)
    first among equals, while nothing else is starting. The modules that restart an engine
    (``restarts[i]``) run last: every other user of a setting has its engine as first started
    (a restarted one once ran unconfined, on the proxy's core)."""
    parent: dict[S, S] = {}

    def root(s: S) -> S:
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for need in needs:
        first = None
        for s in need:
            parent.setdefault(s, s)
            if first is None:
                first = root(s)
            else:
                parent[root(s)] = first
    groups: dict[S, set[S]] = {}
    for s in parent:
        groups.setdefault(root(s), set()).add(s)
    # Largest first; ties in the order of first use, so that the plan is stable.
    first_use = {s: i for i, need in reversed(list(enumerate(needs))) for s in need}
    ordered = sorted(groups.values(), key=lambda g: (-len(g), min(first_use[s] for s in g)))
    packed: list[set[S]] = []
    for group in ordered:
        home = next((w for w in packed if len(w) + len(group) <= capacity), None)
        if home is None:
            packed.append(set(group))
        else:
            home |= group
    is_quiet = list(quiet) or [False] * len(needs)
    is_restart = list(restarts) or [False] * len(needs)
    return [
        Wave(
            frozenset(w),
            tuple(
                sorted(
                    (i for i, need in enumerate(needs) if need and need <= w),
                    key=lambda i: (is_restart[i], len(needs[i]), not is_quiet[i], i),
                )
            ),
        )
        for w in packed
    ]


def order(
    needs: Sequence[frozenset[S]],
    weights: Sequence[int],
    capacity: int,
    quiet: Sequence[bool] = (),
    restarts: Sequence[bool] = (),
) -> list[int]:
    """Indices of the modules (``needs[i]``: the settings module i uses, ``weights[i]``: its
    test count, ``quiet[i]``: it measures its engines, ``restarts[i]``: it restarts one) in
    the order to run them."""
    planned = waves(needs, capacity, quiet, restarts)
    free = [i for i, need in enumerate(needs) if not need]
    if not planned:
        return free
    fillers = split(free, weights, [len(w.settings) for w in planned])
    run: list[int] = []
    for filler, wave in zip(fillers, planned, strict=True):
        run += filler + list(wave.units)
    return run


def split(units: Sequence[int], weights: Sequence[int], shares: Sequence[int]) -> list[list[int]]:
    """``units`` cut, in order, into ``len(shares)`` runs whose weights follow ``shares``."""
    total = sum(weights[u] for u in units)
    whole = sum(shares)
    runs: list[list[int]] = [[] for _ in shares]
    done = 0
    run = 0
    bound = total * shares[0] / whole
    for u in units:
        # A unit goes to the run whose share its middle falls in.
        middle = done + weights[u] / 2
        while run < len(shares) - 1 and middle > bound:
            run += 1
            bound += total * shares[run] / whole
        runs[run].append(u)
        done += weights[u]
    return runs
