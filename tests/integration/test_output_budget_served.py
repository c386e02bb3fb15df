"""Output budgets past the model's context, against `tierproxy serve` (a subprocess) in front of
a real CPU vLLM (its context 2,048): vLLM's chat refuses a ``max_tokens`` past
``max_model_len``. A client's gets that 400 at once, while another tenant's generations hold
the backend's token budget (it waited for an idle backend, then a 503 to retry after its queue
timeout: red team, stop 50); a tenant whose ``tokens_per_minute`` share is past the context
is served, the proxy's own ``max_tokens`` cut to the context (every such request got vLLM's
400). Nothing is timed: the refusal is seen while the engine still runs the generations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.bench.hostile.served import ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.config.tenants import hash_key
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PROMPT_DETAILS
from tests.helpers.kvpair import inflight

pytestmark = [pytest.mark.integration, pytest.mark.engines(PROMPT_DETAILS)]
CHAT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=600)
# tenant-high's generations, each booked 1,800+ tokens of the backend's budget, four at a time:
# the backend is idle only after four waves of them, far past the refusals however fast the
# engine decodes (stop 50's CI finished one wave of four 1,200-token ones between the two
# refusals). Their clients leave once the refusals are seen, so a slow engine is not waited for.
BUSY = 16
WAVE = 4
BUSY_TOKENS = 1_800


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PROMPT_DETAILS)


async def _context_known(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether the proxy's /v1/models (its last probe of the engine's, models_interval_s)
    gives the model's context: what it refuses a budget past the context by."""
    headers = {"Authorization": f"Bearer {KEYS['low']}"}
    async with session.get(url + "/v1/models", headers=headers) as resp:
        cards = (await resp.json()).get("data", []) if resp.status == 200 else []
    return any(card.get("id") == "tiny" and card.get("max_model_len") for card in cards)


def _outcome(task: asyncio.Task[tuple[int, dict[str, object]]]) -> str:
    if not task.done():
        return "running"
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    return repr(error) if error is not None else str(task.result()[0])


async def test_a_max_tokens_past_the_context_is_refused_at_once_and_a_share_past_it_is_served(
    engine: EngineProcess, tmp_path: Path
) -> None:
    tenants: list[dict[str, Any]] = [
        {"name": "tenant-high", "tier": "high", "keys": [{"sha256": hash_key(KEYS["high"])}]},
        {
            "name": "tenant-normal",
            "tier": "normal",
            "keys": [{"sha256": hash_key(KEYS["normal"])}],
            "tokens_per_minute": 100_000,  # a share past the context
        },
        {"name": "tenant-low", "tier": "low", "keys": [{"sha256": hash_key(KEYS["low"])}]},
    ]
    # The busy generations take most of the token budget: a request booked at n x 1,000,000
    # (or n x the context, 16,384) would wait for the backend to be idle.
    backend = {"url": engine.spec.url, "max_inflight": WAVE, "max_tokens_inflight": 8_000}
    # The last request may run to the context's end (2,048 tokens) on a slow, busy machine.
    tiers = {"normal": {"request_timeout_s": 600}}
    config = make_config([backend], tiers=tiers, tenants=tenants) | admin_sections()
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

            async def post(tier: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
                headers = {"Authorization": f"Bearer {KEYS[tier]}"}
                async with session.post(proxy.url + CHAT, json=body, headers=headers) as r:
                    return r.status, await r.json()

            messages = [{"role": "user", "content": "hello there"}]
            long = {"model": "tiny", "messages": messages, "max_tokens": BUSY_TOKENS}
            long["ignore_eos"] = True
            # The proxy refuses by the context its probe of the engine's /v1/models gave: a
            # probe that a busy machine timed out (it is tried again) is waited for.
            for _ in range(600):  # polls
                if await _context_known(session, proxy.url):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the proxy never learnt the model's context")
            busy = [asyncio.create_task(post("high", long)) for _ in range(BUSY)]
            try:
                # The budget held: a wave of them in flight, as the proxy counts (read from the
                # proxy, on its own core: a scrape of the busy engine can lag by seconds).
                for _ in range(600):  # polls
                    if (await inflight(session, proxy))[0] >= WAVE:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the generations never held the backend's budget")
                for field in ("max_tokens", "max_completion_tokens"):
                    absurd = {"model": "tiny", "messages": messages, field: 1_000_000, "n": 8}
                    sent = asyncio.get_running_loop().time()
                    status, answer = await post("low", absurd)
                    took = asyncio.get_running_loop().time() - sent
                    error = answer["error"]
                    assert status == 400 and isinstance(error, dict), answer
                    assert error["param"] == field, error
                    assert "cannot be greater than max_model_len=2048" in str(error["message"])
                    # Answered while generations are unfinished: it never waited for an idle
                    # backend (the bug answered it only once every one had ended).
                    outcomes = [_outcome(task) for task in busy]
                    assert "running" in outcomes, f"answered after the backend idled ({took:.2f} s; the generations: {outcomes})"  # fmt: skip
            finally:
                for task in busy:  # their clients leave: the proxy aborts them in the engine
                    task.cancel()
                await asyncio.gather(*busy, return_exceptions=True)
            # No max_tokens from a tenant whose tokens_per_minute share (100,000) is past the
            # context: vLLM serves it, to the context's end at most.
            status, answer = await post("normal", {"model": "tiny", "messages": messages})
            assert status == 200, answer
            usage = answer["usage"]
            assert isinstance(usage, dict) and 0 < usage["completion_tokens"] <= 2048, usage
