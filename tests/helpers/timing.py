"""Waits bounded in steps, not seconds: a busy machine makes each step later, so it can only
count fewer of them, never fail a bound it would meet on a quiet one."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def polls_until(
    condition: Callable[[], bool | Awaitable[bool]],
    max_polls: int,
    what: str,
    interval_s: float = 0.05,
) -> int:
    """Checks ``condition`` every ``interval_s`` until it holds; how many sleeps that took.
    Fails past ``max_polls`` (what ``max_polls x interval_s`` of a quiet machine allows)."""
    polls = 0
    while True:
        held = condition()
        if await held if inspect.isawaitable(held) else held:
            return polls
        polls += 1
        assert polls <= max_polls, f"{what}: not after {max_polls} polls of {interval_s:g} s"
        await asyncio.sleep(interval_s)


async def timer_lateness_s(delay_s: float) -> float:
    """How long a ``delay_s`` timer on this loop really takes now: the same load, counted in
    the same units, as a timer of the code under test that runs beside it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.sleep(delay_s)
    return loop.time() - started
