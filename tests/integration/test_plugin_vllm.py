"""The plugin on real vLLM (CPU build, tiny model), beside stock vLLM with the same settings.

Two engines, started once for the module: ``stock`` (priority scheduling, no plugin) and
``plugin`` (same flags plus --middleware / --scheduler-cls). Latencies are read from vLLM's own
engine-side numbers (per-request metrics, ITL histogram), see proxy/bench/plugin/.
"""

from __future__ import annotations

import asyncio
import time
from typing import BinaryIO

import pytest

from proxy.bench.plugin import scenarios as sc
from proxy.bench.plugin.requests import LOW_TOKENS
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PLUGIN_ON, PLUGIN_SECRET, PLUGIN_STOCK

pytestmark = [
    pytest.mark.integration,
    pytest.mark.engines(PLUGIN_STOCK, PLUGIN_ON),
    pytest.mark.quiet_engines,  # A/B figures: nothing starts beside the two engines
]

KEY = PLUGIN_SECRET.encode()


@pytest.fixture(scope="module")
def stock(engines: EngineFarm) -> EngineProcess:
    return engines.get(PLUGIN_STOCK)


# Read handles on the plugin engines' logs, opened as soon as the engine is: a concurrent
# pytest session on the same machine may prune this session's temporary directory.
_LOGS: dict[str, BinaryIO] = {}


@pytest.fixture(scope="module")
def plugin(engines: EngineFarm) -> EngineProcess:
    engine = engines.get(PLUGIN_ON)
    if engine.spec.url not in _LOGS and engine.log_path is not None:
        _LOGS[engine.spec.url] = engine.log_path.open("rb")
    return engine


def plugin_counters(engine: EngineProcess) -> dict[str, int]:
    """The last ``tierproxy counters:`` line the plugin's scheduler logged in the engine core."""
    log = _LOGS[engine.spec.url]
    log.seek(0)
    lines = [ln for ln in log.read().decode(errors="replace").splitlines() if _COUNTERS in ln]
    if not lines:
        return {}
    pairs = (kv.split("=", 1) for kv in lines[-1].split(_COUNTERS, 1)[1].split())
    return {k: int(v) for k, v in pairs}


_COUNTERS = "tierproxy counters:"


async def counters_after(
    engine: EngineProcess, before: dict[str, int], key: str, timeout_s: float = 10.0
) -> dict[str, int]:
    """The plugin's counters once ``key`` rose past ``before`` (logged every second of work)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = plugin_counters(engine)
        if now.get(key, 0) > before.get(key, 0) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.2)


async def test_high_tier_preempts_long_low_tier_generations(
    stock: EngineProcess, plugin: EngineProcess
) -> None:
    with_stock = await sc.preempt_scenario(stock.spec.url, KEY)
    with_plugin = await sc.preempt_scenario(plugin.spec.url, KEY)
    # Client-side times only for display, and only where text arrived: the tiny random model's
    # tokens can decode to empty text (a held-back partial character), which the engine's
    # clock still counts. The assertions below use the engine's figures.
    client = " / ".join(
        f"{r.high.ttft * 1000:.0f}" if r.high.token_times else "-"
        for r in (with_stock, with_plugin)
    )
    print(
        f"\nhigh-tier TTFT behind 4 long low-tier generations (engine clock): "
        f"stock {with_stock.high.server_ttft * 1000:.1f} ms, "
        f"plugin {with_plugin.high.server_ttft * 1000:.1f} ms (client-side {client} ms)"
    )
    assert with_stock.preemptions == 0  # stock vLLM never preempts for priority alone
    assert with_plugin.preemptions >= 1
    assert with_plugin.high.server_ttft * 10 <= with_stock.high.server_ttft
    for outcome in (with_stock, with_plugin):
        assert outcome.high.finish_reason == "length" and outcome.high.completion_tokens == 16
        for low in outcome.lows:  # preempted ones included: full output, normal end
            assert low.status == 200
            assert (low.finish_reason, low.completion_tokens) == ("length", LOW_TOKENS)


async def test_forged_or_unsigned_priority_gains_nothing(plugin: EngineProcess) -> None:
    outcome = await sc.forged_scenario(plugin.spec.url, KEY)
    control = outcome.control
    print(f"\ncontrol (signed high) queued {control.queue_time * 1000:.1f} ms (engine clock)")
    for name, r in outcome.attacks.items():
        print(f"{name}: queued {r.queue_time * 1000:.1f} ms")
    assert control.status == 200 and control.completion_tokens == 4
    for r in outcome.attacks.values():
        assert r.status == 200 and r.completion_tokens == 4
        # Ran at the lowest tier: queued until a low-tier request left, while the signed
        # high-tier request, sent after them, got in at once.
        assert r.queue_time > 10 * control.queue_time
    # Only the signed high-tier request preempted anything.
    assert outcome.preemptions == 1


async def test_request_whose_deadline_passes_while_waiting_never_runs(
    plugin: EngineProcess,
) -> None:
    outcome = await sc.deadline_scenario(plugin.spec.url, KEY)
    streamed, plain = outcome.streamed, outcome.plain
    print(f"\ndeadline requests answered after {outcome.answered_after_s * 1000:.0f} ms")
    # Both ended properly (200, [DONE] for the stream) without a single generated token ...
    assert streamed.status == 200 and streamed.done_marker and not streamed.error
    assert streamed.completion_tokens == 0 and streamed.token_times == []
    assert plain.status == 200 and plain.finish_reason == "abort"
    assert plain.completion_tokens == 0
    # ... finished by the engine as aborted (not run later: vLLM counts each request once).
    assert outcome.aborted == 2
    assert all(r.completion_tokens == LOW_TOKENS for r in outcome.lows)


@pytest.mark.long  # a measurement under load (ITL p99 with and without the plugin)
async def test_long_low_prompt_raises_high_itl_p99_less_with_plugin(
    stock: EngineProcess, plugin: EngineProcess
) -> None:
    with_stock = await sc.itl_scenario(stock.spec.url, KEY)
    before = plugin_counters(plugin)
    with_plugin = await sc.itl_scenario(plugin.spec.url, KEY)
    after = await counters_after(plugin, before, "prefill_tokens_deferred")
    print(
        f"\nhigh-tier ITL while 24 4000-token low-tier prompts arrive (vLLM histogram): "
        f"stock p50 {with_stock.p50 * 1000:.2f} ms p99 {with_stock.p99 * 1000:.2f} ms "
        f"({with_stock.samples} samples); "
        f"plugin p50 {with_plugin.p50 * 1000:.2f} ms p99 {with_plugin.p99 * 1000:.2f} ms "
        f"({with_plugin.samples} samples); plugin counters {before} -> {after}"
    )
    for outcome in (with_stock, with_plugin):
        assert all(r.status == 200 and r.completion_tokens == 1 for r in outcome.longs)
        assert outcome.highs_outlived_window  # the samples are of decodes beside the prefills
    # Stock runs each 4000-token prefill in one step beside the decodes; the plugin lets it
    # take at most 0.2 of a step (819 tokens) while a better tier decodes: its own counters
    # show the cap at work ...
    assert after.get("capped_steps", 0) > before.get("capped_steps", 0)
    assert after.get("prefill_tokens_deferred", 0) > before.get("prefill_tokens_deferred", 0)
    # ... and the decodes' p99 stays well below stock's (two ITL buckets or more apart).
    assert with_plugin.p99 * 1.5 <= with_stock.p99
