"""Fairness by the work caused, on real vLLM with prefix caching and
``--enable-prompt-tokens-details``: two backlogged tenants of one tier send the same prompts
(same length, same output), one of them the same prompt again and again (it hits vLLM's
prefix cache), the other a fresh one each time. The proxy charges cached prompt tokens at
``policies.vtc.cached_prompt_charge``, so the reusing tenant is served more, by that fraction.

One engine, one slot: requests run one at a time, in the order the proxy dispatches them.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aiohttp
import pytest

from proxy.bench.inproc import make_config, running_proxy, until
from proxy.config.tenants import hash_key
from proxy.policies.cost import work_tokens
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PROMPT_DETAILS

pytestmark = [pytest.mark.integration, pytest.mark.engines(PROMPT_DETAILS)]
TIMEOUT = aiohttp.ClientTimeout(total=120)
FRACTION = 0.1
EACH = 14  # requests per tenant, all sent at once
WINDOW = 12  # completions counted: both tenants still have requests queued throughout


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PROMPT_DETAILS)


def _prompt() -> str:
    """About 500 tokens of the tiny model that no earlier request has cached (a fresh random head)."""
    return f"{secrets.token_hex(8)} " + " ".join(f"word{i % 97}" for i in range(100))


async def test_the_tenant_whose_prompts_hit_the_cache_is_served_more_by_the_fraction(
    engine: EngineProcess,
) -> None:
    tenants = [
        {"name": name, "tier": "normal", "keys": [{"sha256": hash_key(f"key-{name}")}]}
        for name in ("reuse", "fresh")
    ]
    config = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tenants=tenants,
        policies={"vtc": {"cached_prompt_charge": FRACTION}},
    )
    shared = _prompt()
    done: list[tuple[str, dict[str, Any]]] = []  # (tenant, usage) in completion order
    async with (
        running_proxy(config) as (base, state),
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):

        async def send(tenant: str, prompt: str) -> dict[str, Any]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            headers = {"Authorization": f"Bearer key-{tenant}"}
            async with session.post(f"{base}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                usage: dict[str, Any] = (await r.json())["usage"]
            done.append((tenant, usage))
            return usage

        warm = await send("reuse", shared)  # the shared prompt is cached from now on
        assert not (warm.get("prompt_tokens_details") or {}).get("cached_tokens")
        done.clear()
        # Nothing dispatched until all 28 are queued (a fast engine served the first ones as
        # they came, in their order of arrival): the backend drained meanwhile, as an admin would.
        url = state.pool.all()[0].cfg.url
        state.pool.drain(url)
        sent = asyncio.gather(
            *(send("reuse", shared) for _ in range(EACH)),
            *(send("fresh", _prompt()) for _ in range(EACH)),
        )
        await until(lambda: state.queue.depth("normal") == 2 * EACH, what="all queued", state=state)
        state.pool.drain(url, False)
        state.dispatcher.kick()
        await sent

    def charge(usage: dict[str, Any]) -> float:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return work_tokens(usage["prompt_tokens"], cached, usage["completion_tokens"], FRACTION)

    reuse = [u for t, u in done if t == "reuse"]
    fresh = [u for t, u in done if t == "fresh"]
    # vLLM says the reusing tenant's prompts hit (all but the last partial block) and the
    # fresh ones did not: the two send the same token volume, at very different work.
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= 448 for u in reuse), reuse
    assert all(not (u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in fresh)
    lengths = [u["prompt_tokens"] for _, u in done]  # a random hex head: a few tokens either way
    assert max(lengths) - min(lengths) <= 0.01 * min(lengths), lengths
    # Equal charges while both are backlogged: served in inverse proportion to each one's.
    cr, cf = charge(reuse[0]), charge(fresh[0])
    first = [t for t, _ in done[:WINDOW]]
    served = first.count("reuse")
    expected = WINDOW * cf / (cr + cf)  # about 10.3 of 12 at 0.1 (6 of 12 at 1.0)
    print(f"charge reuse {cr:.1f} fresh {cf:.1f}: reuse served {served}/{WINDOW}, ~{expected:.1f}")
    assert abs(served - expected) <= 1.5, (first, expected)
