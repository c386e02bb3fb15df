"""The capacity step: the saturation rate, in requests per second of a scenario's own mix.

Closed loop: ``concurrency`` workers each send the next request of the mix as soon as their
last one is answered, for ``duration_s``; completions after the warm-up, per second, are the
capacity. Scenarios with a ``load`` then run at ``load x capacity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from proxy.bench.client import ClientSettings, send
from proxy.bench.plan import make_prompt
from proxy.bench.records import Outcome, PlannedRequest, RequestRecord
from proxy.bench.scenario import Scenario


@dataclass(frozen=True)
class Capacity:
    rps: float
    output_tokens_per_s: float
    concurrency: int
    window_s: float
    completed: int
    failed: int
    base_url: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def mix(scenario: Scenario, seed: int, count: int) -> Iterator[PlannedRequest]:
    """Up to ``count`` requests drawn lazily from the scenario's tenants by share (at 0)."""
    rng = random.Random(f"{seed}:capacity")
    tenants = scenario.tenants
    weights = [t.share for t in tenants]
    for i in range(count):
        tenant = rng.choices(tenants, weights)[0]
        words = rng.randint(*tenant.prompt_words)
        yield (
            PlannedRequest(
                index=i,
                at=0.0,
                tenant=tenant.name,
                tier=tenant.tier,
                key=tenant.api_key,
                prompt=make_prompt(rng, tenant, i, words),
                max_tokens=rng.randint(*tenant.max_tokens),
            )
        )


async def measure_capacity(
    scenario: Scenario,
    base_url: str,
    model: str,
    *,
    seed: int = 0,
    duration_s: float = 20.0,
    warmup_s: float = 4.0,
    concurrency: int = 32,
    request_timeout_s: float = 60.0,
) -> Capacity:
    if not 0 <= warmup_s < duration_s:
        raise ValueError("warm-up must be shorter than the measurement")
    t0 = time.monotonic()
    settings = ClientSettings(
        base_url=base_url,
        model=model,
        t0=t0,
        request_timeout_s=request_timeout_s,
        run_id="capacity",
    )
    done: list[RequestRecord] = []
    cursor = mix(scenario, seed, scenario.max_requests)

    async def worker(session: aiohttp.ClientSession) -> None:
        for planned in cursor:
            if time.monotonic() - t0 >= duration_s:
                return
            now = time.monotonic() - t0
            rec = await send(session, _at(planned, now), settings)
            done.append(rec)

    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        try:
            await asyncio.wait(workers, timeout=duration_s)
        finally:
            # Requests still running at the end are abandoned (vLLM aborts them).
            for w in workers:
                w.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*workers, return_exceptions=True), timeout=10.0
                )
    window = duration_s - warmup_s
    counted = [r for r in done if r.end is not None and warmup_s <= r.end <= duration_s]
    ok = [r for r in counted if r.outcome is Outcome.OK]
    return Capacity(
        rps=round(len(ok) / window, 3),
        output_tokens_per_s=round(sum(r.output_tokens or 0 for r in ok) / window, 1),
        concurrency=concurrency,
        window_s=window,
        completed=len(ok),
        failed=len(counted) - len(ok),
        base_url=base_url,
    )


def _at(planned: PlannedRequest, now: float) -> PlannedRequest:
    return PlannedRequest(
        index=planned.index,
        at=now,
        tenant=planned.tenant,
        tier=planned.tier,
        key=planned.key,
        prompt=planned.prompt,
        max_tokens=planned.max_tokens,
    )
