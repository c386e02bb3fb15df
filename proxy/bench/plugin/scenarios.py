"""The plugin's scenarios: each fills one vLLM server (stock or with the plugin) with long
low-tier generations, sends what the scenario is about, and returns what was measured, read
from vLLM's own engine-side numbers where the client's clock would blur them.

Shared by the plugin's integration tests (tests/integration/test_plugin_vllm.py) and its
benchmark (benchmarks/plugin_bench.py). A scenario whose precondition did not hold (the machine
delayed this client) is run again, at most ``attempts`` times.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from proxy.bench.plugin.gauges import delta, histogram_quantile, scrape, settle, wait_gauges
from proxy.bench.plugin.preconditions import (
    QUEUED_BEHIND_S,
    NotEstablished,
    cancel_all,
    fill_slots_with_low,
    retry_scenario,
)
from proxy.bench.plugin.requests import (
    HIGH_PRIORITY,
    LOW_TOKENS,
    Completion,
    StreamResult,
    complete,
    high,
    low,
    new_session,
    stream_completion,
    ticket_headers,
    token_prompt,
)


@dataclass
class PreemptOutcome:
    high: StreamResult
    lows: list[Completion]
    preemptions: float  # vllm:num_preemptions_total during the scenario


async def preempt_scenario(
    url: str,
    secret: bytes,
    *,
    slots: int = 4,
    low_tokens: int = LOW_TOKENS,
    high_tokens: int = 16,
    attempts: int = 4,
) -> PreemptOutcome:
    """``slots`` long low-tier generations fill vLLM; then one high-tier request arrives."""

    async def once() -> PreemptOutcome:
        async with new_session() as session:
            await settle(session, url)
            before = await scrape(session, url)
            lows = await fill_slots_with_low(session, url, secret, n=slots, max_tokens=low_tokens)
            high_task = asyncio.create_task(
                stream_completion(
                    session,
                    url,
                    prompt=token_prompt(16),
                    max_tokens=high_tokens,
                    headers=high(secret),
                )
            )
            high_result = await high_task
            low_results = list(await asyncio.gather(*lows))
            after = await scrape(session, url)
        preemptions = delta(after, before, "vllm:num_preemptions_total")
        # Read after the run, from vLLM: the high request found every slot taken by a low-tier
        # one with much left to generate: it preempted one (plugin) or queued for a long time
        # (stock, or a plugin that fails to preempt: then the assertions catch it).
        queue_s = float(high_result.metrics.get("queue_time_ms") or 0.0) / 1000
        if preemptions == 0 and queue_s < QUEUED_BEHIND_S:
            raise NotEstablished(
                f"the high-tier request did not arrive behind {slots} long low-tier ones "
                f"(queued {queue_s * 1000:.1f} ms, no preemption)"
            )
        return PreemptOutcome(high=high_result, lows=low_results, preemptions=preemptions)

    return await retry_scenario(attempts, once, "preempt scenario")


@dataclass
class ForgedOutcome:
    control: Completion  # a signed high-tier request, sent after the attacks
    attacks: dict[str, Completion]
    preemptions: float


FORGED_ATTACKS: dict[str, dict[str, Any]] = {
    "forged ticket": {"forged": True},
    "body priority -1000": {"extra": {"priority": -1000}},
    "X-Vllm-Priority -1000": {"headers": {"X-Vllm-Priority": "-1000"}},
    "unsigned xargs": {
        "extra": {"vllm_xargs": {"tierproxy_priority": -1000, "tierproxy_trusted": 1}}
    },
}


async def forged_scenario(url: str, secret: bytes, *, attempts: int = 4) -> ForgedOutcome:
    """Four long low-tier generations run; forged / unsigned priority claims arrive, then a
    signed high-tier request. Each attack should queue like the lowest tier."""

    async def once() -> ForgedOutcome:
        async with new_session() as session:
            await settle(session, url)
            before = await scrape(session, url)
            lows = await fill_slots_with_low(session, url, secret, n=4, max_tokens=LOW_TOKENS)
            tasks = {}
            for name, attack in FORGED_ATTACKS.items():
                headers = dict(attack.get("headers", {}))
                if attack.get("forged"):
                    headers.update(
                        ticket_headers(b"not-the-secret", tier="high", priority=HIGH_PRIORITY)
                    )
                tasks[name] = asyncio.create_task(
                    complete(
                        session,
                        url,
                        prompt=token_prompt(8),
                        max_tokens=4,
                        headers=headers,
                        extra=attack.get("extra"),
                    )
                )
            # The control right behind the attacks, with no wait between: the fewer moments
            # this client needs the CPU, the surer all of them reach vLLM while the lows run.
            # (Either order proves the point: an attack can only queue, the control preempts.)
            control = await complete(
                session, url, prompt=token_prompt(8), max_tokens=4, headers=high(secret)
            )
            await asyncio.gather(*lows)
            attacks = {name: await task for name, task in tasks.items()}
            after = await scrape(session, url)
        preemptions = delta(after, before, "vllm:num_preemptions_total")
        # Read after the run, from vLLM: the lows still held every slot when the control (sent
        # after the attacks) arrived, so it preempted one (or, were preemption broken, queued).
        if preemptions == 0 and control.queue_time < QUEUED_BEHIND_S:
            raise NotEstablished("the low-tier requests left before the control reached vLLM")
        return ForgedOutcome(
            control=control,
            attacks=attacks,
            preemptions=preemptions,
        )

    return await retry_scenario(attempts, once, "forged-priority scenario")


@dataclass
class DeadlineOutcome:
    streamed: StreamResult
    plain: Completion
    lows: list[Completion]
    aborted: float  # vllm:request_success_total{finished_reason="abort"} during the scenario
    answered_after_s: float  # client clock, for the report only


async def deadline_scenario(
    url: str, secret: bytes, *, deadline_s: float = 1.5, attempts: int = 4
) -> DeadlineOutcome:
    """Four long low-tier generations run; two low-tier requests (one streaming) arrive with a
    deadline that passes while they wait behind them."""

    async def once() -> DeadlineOutcome:
        async with new_session() as session:
            await settle(session, url)
            before = await scrape(session, url)
            lows = await fill_slots_with_low(session, url, secret, n=4, max_tokens=LOW_TOKENS)
            sent = time.perf_counter()
            streamed_task = asyncio.create_task(
                stream_completion(
                    session,
                    url,
                    prompt=token_prompt(8),
                    max_tokens=LOW_TOKENS,
                    headers=low(secret, deadline_s=deadline_s),
                )
            )
            plain_task = asyncio.create_task(
                complete(
                    session,
                    url,
                    prompt=token_prompt(8),
                    max_tokens=LOW_TOKENS,
                    headers=low(secret, deadline_s=deadline_s),
                )
            )
            # Both waiting behind the four running lows, by vLLM's gauges (best effort: a
            # starved API server can answer /metrics too late to show it).
            queued = await wait_gauges(
                session,
                url,
                running=4,
                waiting=2,
                timeout_s=deadline_s,
                while_pending=[*lows, streamed_task, plain_task],
            )
            streamed, plain = await streamed_task, await plain_task
            low_results = list(await asyncio.gather(*lows))
            after = await scrape(session, url)
        # Not a single token for either: they never ran, so every slot was taken when they
        # arrived, as the scenario wants; so does a long wait in vLLM's queue. Tokens after a
        # short wait, never seen waiting: they arrived after the lows had left (then they ran,
        # which proves nothing either way).
        produced = (streamed.completion_tokens or 0) + (plain.completion_tokens or 0)
        if not queued and produced > 0 and plain.queue_time < QUEUED_BEHIND_S:
            raise NotEstablished(
                f"the deadline requests were not seen waiting behind four running low-tier "
                f"ones, and they produced {produced} tokens"
            )
        return DeadlineOutcome(
            streamed=streamed,
            plain=plain,
            lows=low_results,
            aborted=delta(after, before, "vllm:request_success_total|abort"),
            answered_after_s=max(streamed.done_at, plain.done_at) - sent,
        )

    return await retry_scenario(attempts, once, "deadline scenario")


@dataclass
class ItlOutcome:
    p50: float  # seconds, bucket upper bounds of vLLM's inter-token latency histogram
    p99: float
    samples: int
    longs: list[Completion]
    highs_outlived_window: bool  # the high-tier requests decoded through the whole window


async def itl_scenario(
    url: str,
    secret: bytes,
    *,
    n_high: int = 2,
    n_long: int = 24,
    long_len: int = 4000,
    spacing_s: float = 0.01,
    attempts: int = 4,
) -> ItlOutcome:
    """High-tier requests decode while long low-tier prompts arrive.

    The ITL window opens as the high-tier requests are sent and closes when the last long prompt
    is answered; the long prompts ask for one token each, so every ITL sample vLLM records in
    the window belongs to a high-tier request. Nothing streams: the API server's CPU goes to
    admitting the long prompts, not to SSE, so they reach the engine while the highs decode.
    The high-tier requests are cut off (client disconnect, vLLM aborts them) after the window.
    """
    name = "vllm:inter_token_latency_seconds"

    async def once() -> ItlOutcome:
        async with new_session() as session:
            await settle(session, url)
            before = await scrape(session, url)
            # The highs first: a long prompt that lands in the highs' own first step (nothing
            # decodes yet, so the plugin does not cap it) only delays their first token, which
            # is not an inter-token latency.
            highs = [
                asyncio.create_task(
                    complete(
                        session,
                        url,
                        prompt=token_prompt(16),
                        max_tokens=4000,
                        headers=high(secret),
                    )
                )
                for _ in range(n_high)
            ]
            await asyncio.sleep(0)
            long_tasks = []
            for _ in range(n_long):
                long_tasks.append(
                    asyncio.create_task(
                        complete(
                            session,
                            url,
                            prompt=token_prompt(long_len),
                            max_tokens=1,
                            headers=low(secret),
                        )
                    )
                )
                await asyncio.sleep(spacing_s)
            longs = list(await asyncio.gather(*long_tasks))
            # The highs (4000 tokens each) were still being answered when the last long prompt
            # was: they decoded through the whole window. Cut them off (vLLM aborts them)
            # before reading the histogram, so that no decode-only samples dilute the window.
            outlived = not any(t.done() for t in highs)
            await cancel_all(highs)
            await settle(session, url)
            after = await scrape(session, url)
        if not outlived:  # e.g. the API server, starved, handed the long prompts on late
            raise NotEstablished("a high-tier request ended before the last long prompt")
        p50, n = histogram_quantile(after, before, name, 0.50)
        p99, _ = histogram_quantile(after, before, name, 0.99)
        # Each long prompt's prefill shares at least one step with the highs' decodes: those
        # samples must be more than 2% of the window for its p99 to be about them. Many more
        # samples mean the highs mostly decoded alone (a starved API server handed the long
        # prompts on slowly).
        if n > 50 * n_high * n_long:
            raise NotEstablished(
                f"{n} ITL samples: the highs mostly decoded without a long prompt beside them"
            )
        return ItlOutcome(p50=p50, p99=p99, samples=n, longs=longs, highs_outlived_window=outlived)

    return await retry_scenario(attempts, once, "ITL scenario")
