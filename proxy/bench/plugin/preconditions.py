"""What every plugin scenario stands on: vLLM's slots filled with long low-tier generations, the
precondition that this held (checked on vLLM's own numbers) and the retry when it did not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from proxy.bench.plugin.gauges import wait_gauges
from proxy.bench.plugin.requests import Completion, complete, low, token_prompt

T = TypeVar("T")


async def fill_slots_with_low(
    session: aiohttp.ClientSession,
    url: str,
    secret: bytes,
    *,
    n: int,
    max_tokens: int,
    timeout_s: float = 2.0,
) -> list[asyncio.Task[Completion]]:
    """Start ``n`` long low-tier generations; return once vLLM's gauge shows all running, or
    after ``timeout_s`` anyway.

    Best effort: a starved API server may answer /metrics only seconds later (it serves it
    from a worker thread that waits for the GIL while the event loop relays tokens). Each
    scenario therefore checks its precondition again afterwards, on numbers vLLM kept itself.
    """
    tasks = [
        asyncio.create_task(
            complete(
                session, url, prompt=token_prompt(16), max_tokens=max_tokens, headers=low(secret)
            )
        )
        for _ in range(n)
    ]
    await wait_gauges(session, url, running=n, timeout_s=timeout_s, while_pending=tasks)
    if any(t.done() for t in tasks):
        results = await asyncio.gather(*tasks, return_exceptions=True)
        raise NotEstablished(f"low-tier requests ended early: {[_brief(r) for r in results]}")
    return tasks


# A request that waited at least this long in vLLM's queue (its own queue_time) arrived while
# the long low-tier generations held every slot, with a good part of them still to go.
QUEUED_BEHIND_S = 1.0


def _brief(result: object) -> str:
    if isinstance(result, Completion):
        return f"{result.status} {result.finish_reason} {result.completion_tokens} tokens"
    return repr(result)


class NotEstablished(Exception):
    """A scenario's precondition did not hold (the machine delayed this client): run it again."""


async def retry_scenario(attempts: int, run: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a scenario until its precondition, checked on vLLM's numbers, held (at most attempts).

    Only the precondition is retried: the outcome's assertions are the caller's, on the one
    run whose precondition held.
    """
    reasons = []
    for _ in range(attempts):
        try:
            return await run()
        except NotEstablished as exc:
            reasons.append(str(exc))
    raise AssertionError(f"{what}: precondition never held in {attempts} attempts: {reasons}")


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
