"""How each tenant's conversations run lately, for ``backends: kv_aware``'s fit rule
(``kvterms.overfills``): how long one grows (the longest prompt the tenant sent, in blocks) and
how many it runs side by side (the most of its requests in flight at once). Each is the largest
seen over the last one to two windows (``WINDOW_S``): a tenant that changes its ways is judged
by them within two windows, and one long prompt long ago does not judge it for ever.

A tenant of one conversation at a time never has two requests in flight: its next
conversation follows the last one, and shares its home's cache with no other of its own. Only
requests the engine ran count (a prompt past the model's context, refused, grows no
conversation), each when it ends. Bounded by the tenants with a request in flight or one that
ran within two windows (swept).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

WINDOW_S = 300.0  # the habits' window: a maximum lasts one to two of these
SWEEP_EVERY = 1024  # sends between sweeps of the tenants whose habits have faded


@dataclass(slots=True)
class _Habit:
    window: int  # the window its ``longest`` and ``side_by_side`` are of
    in_flight: int = 0
    longest: int = 0  # this window's
    side_by_side: int = 0  # this window's
    longest_before: int = 0  # the window before's
    side_by_side_before: int = 0


class TenantHabits:
    def __init__(self, clock: Callable[[], float], window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._habits: dict[str, _Habit] = {}
        # request in flight -> (its tenant, its prompt's blocks, the tenant's in flight then)
        self._flying: dict[Hashable, tuple[str, int, int]] = {}
        self._sends = 0

    def sent(self, key: Hashable, tenant: str, blocks: int) -> None:
        """The request ``key`` of ``tenant``, of a prompt of ``blocks`` full blocks, was sent."""
        self.ended(key, ran=False)  # a request sent again without ending (never expected): once
        habit = self._of(tenant)
        habit.in_flight += 1
        self._flying[key] = (tenant, blocks, habit.in_flight)
        self._sends += 1
        if self._sends % SWEEP_EVERY == 0:
            self._sweep()

    def ended(self, key: Hashable, *, ran: bool) -> None:
        """The request ``key`` ended; ``ran``: the engine worked on it (else it counts for
        nothing)."""
        flight = self._flying.pop(key, None)
        if flight is None:
            return
        tenant, blocks, side_by_side = flight
        habit = self._rolled(tenant)
        if habit is None:
            return
        habit.in_flight = max(0, habit.in_flight - 1)
        if ran:
            habit.longest = max(habit.longest, blocks)
            habit.side_by_side = max(habit.side_by_side, side_by_side)

    def longest(self, tenant: str) -> int:
        """The most full blocks a prompt of ``tenant`` that ran had lately (0: none ran)."""
        habit = self._rolled(tenant)
        return max(habit.longest, habit.longest_before) if habit is not None else 0

    def side_by_side(self, tenant: str) -> int:
        """The most requests ``tenant`` had in flight at once lately, of those that ran (0:
        none ran)."""
        habit = self._rolled(tenant)
        return max(habit.side_by_side, habit.side_by_side_before) if habit is not None else 0

    def __len__(self) -> int:
        return len(self._habits)

    def _window(self) -> int:
        return int(self.clock() // self.window_s)

    def _rolled(self, tenant: str) -> _Habit | None:
        """``tenant``'s habit with its windows brought up to now."""
        habit = self._habits.get(tenant)
        if habit is None:
            return None
        window = self._window()
        if window != habit.window:
            late = window == habit.window + 1
            habit.longest_before = habit.longest if late else 0
            habit.side_by_side_before = habit.side_by_side if late else 0
            habit.longest = habit.side_by_side = 0
            habit.window = window
        return habit

    def _of(self, tenant: str) -> _Habit:
        habit = self._rolled(tenant)
        if habit is None:
            habit = self._habits[tenant] = _Habit(self._window())
        return habit

    def _sweep(self) -> None:
        """Drop the tenants with nothing in flight and nothing run within two windows."""
        for tenant in list(self._habits):
            habit = self._rolled(tenant)
            if habit is not None and not (habit.in_flight or habit.longest or habit.longest_before):
                del self._habits[tenant]
