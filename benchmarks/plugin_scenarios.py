"""Client-side scenarios for the vLLM plugin, shared by its integration tests and benchmark.

Each scenario talks to one vLLM OpenAI server (stock or with the plugin) straight over HTTP,
with tickets signed as the proxy would sign them, and returns what a client measured.
Prompts are lists of token ids, so lengths are exact and no two prompts share a prefix
(vLLM's prefix cache would otherwise make repeated prompts free).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from proxy.ticket import TICKET_HEADER, Ticket, encode_ticket

MODEL = "tiny"
VOCAB = 1024  # the tiny model's vocabulary
HIGH_PRIORITY, LOW_PRIORITY = 0, 10  # the example config's best and worst tiers

T = TypeVar("T")

# Fine ITL buckets, 0.5 ms .. 2 s: vLLM's defaults start at 10 ms, coarser than a CPU step.
ITL_BUCKETS: list[float] = [round(0.0005 * 1.25**i, 6) for i in range(38)]

# Low-tier answers as long as --max-model-len allows (16-token prompts): the four of them must
# still be running when the high-tier request arrives, however late this client gets the CPU.
LOW_TOKENS = 4000

# Settings shared by the stock and the plugin engine, so that only the plugin differs.
# Latencies are read from vLLM itself (engine-core timestamps: per-request metrics and the ITL
# histogram), not from this client: on a loaded 2-core machine a client reads SSE late and in
# bursts, which would blur exactly the step times being compared.
ENGINE_ARGS: tuple[str, ...] = (
    "--max-model-len",
    "4096",  # the tiny model's max_position_embeddings: low-tier answers can be long
    "--max-num-batched-tokens",
    "4096",  # a whole long prompt fits one step: what stock vLLM does to decoders beside it
    "--enable-per-request-metrics",
    "--custom-histogram-buckets",
    json.dumps({"inter_token_latency": ITL_BUCKETS}),
)


def ticket_headers(
    secret: bytes,
    *,
    tier: str,
    priority: int,
    deadline_s: float = 300.0,
    prefill_share: float = 1.0,
    budget: int = 4096,
) -> dict[str, str]:
    ticket = Ticket(
        tier=tier,
        priority=priority,
        tenant="bench",
        deadline=time.time() + deadline_s,
        prefill_share=prefill_share,
        budget=budget,
        request_id=f"{tier}-{random.getrandbits(32):08x}",
    )
    return {TICKET_HEADER: encode_ticket(ticket, secret)}


def high(secret: bytes, **kw: Any) -> dict[str, str]:
    return ticket_headers(secret, tier="high", priority=HIGH_PRIORITY, prefill_share=1.0, **kw)


def low(secret: bytes, **kw: Any) -> dict[str, str]:
    return ticket_headers(secret, tier="low", priority=LOW_PRIORITY, prefill_share=0.2, **kw)


# Unseeded: a rerun against the same engine must not hit its prefix cache.
_rng = random.Random()


def token_prompt(length: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(length)]


@dataclass
class StreamResult:
    status: int
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    done_at: float = 0.0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: Any = None
    done_marker: bool = False  # saw `data: [DONE]`: the stream ended properly
    metrics: dict[str, Any] = field(default_factory=dict)  # vLLM's per-request metrics

    @property
    def server_ttft(self) -> float:
        """Queued to first token, in seconds, by the engine's own clock."""
        queue_ms = self.metrics.get("queue_time_ms") or 0.0
        ttft_ms = self.metrics.get("time_to_first_token_ms")
        if ttft_ms is None:
            raise AssertionError(f"no per-request metrics (status {self.status}, {self.error})")
        return float(queue_ms + ttft_ms) / 1000

    @property
    def ttft(self) -> float:
        if not self.token_times:
            raise AssertionError(f"no token received (status {self.status}, {self.error})")
        return self.token_times[0] - self.sent_at

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    *,
    prompt: list[int] | str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    started: asyncio.Event | None = None,
) -> StreamResult:
    """POST /v1/completions with stream=true; one timestamp per content chunk."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra or {})
    result = StreamResult(status=0, sent_at=time.perf_counter())
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        result.status = resp.status
        if resp.status != 200:
            result.error = await resp.text()
            result.done_at = time.perf_counter()
            return result
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                result.done_marker = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = chunk["error"]
                continue
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("metrics"):
                result.metrics = chunk["metrics"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    result.token_times.append(time.perf_counter())
                    if started is not None:
                        started.set()
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    result.done_at = time.perf_counter()
    return result


@dataclass
class Completion:
    """A non-streaming answer: what the client finally got."""

    status: int
    body: dict[str, Any]
    done_at: float

    @property
    def finish_reason(self) -> str | None:
        choices = self.body.get("choices") or [{}]
        reason = choices[0].get("finish_reason")
        return str(reason) if reason is not None else None

    @property
    def completion_tokens(self) -> int | None:
        usage = self.body.get("usage") or {}
        value = usage.get("completion_tokens")
        return int(value) if value is not None else None

    @property
    def queue_time(self) -> float:
        return float((self.body.get("metrics") or {}).get("queue_time_ms") or 0.0) / 1000


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    *,
    prompt: list[int] | str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Completion:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    body.update(extra or {})
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        payload = await resp.json(content_type=None)
        return Completion(status=resp.status, body=payload, done_at=time.perf_counter())


RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


async def wait_gauges(
    session: aiohttp.ClientSession,
    url: str,
    *,
    running: int,
    waiting: int = 0,
    timeout_s: float = 30.0,
    while_pending: list[asyncio.Task[Any]] | None = None,
) -> bool:
    """Until vLLM's own gauges show ``running`` requests running and ``waiting`` waiting.

    The gauges come from the engine core's stats of each step, so this states what vLLM was
    doing, however late this client gets the CPU. False when not seen within ``timeout_s``, or
    once any of ``while_pending`` is done (the state can no longer appear).
    """
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:  # a starved API server may hold /metrics for seconds: give up at the deadline
            samples = await asyncio.wait_for(scrape(session, url), timeout=left)
        except TimeoutError:
            return False
        if samples.get(RUNNING, 0.0) >= running and samples.get(WAITING, 0.0) >= waiting:
            return True
        if while_pending and any(t.done() for t in while_pending):
            return False
        # Straight on to the next read, woken by its answer, not by a timer: on the loaded
        # VM this was measured on, a client timer (asyncio.sleep) often fired only when the
        # next socket event came, i.e. when the long low-tier answers arrived.
        await asyncio.sleep(0)
    return False


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


def new_session() -> aiohttp.ClientSession:
    """One connection per request: a pooled keep-alive connection that uvicorn closes (its 5 s
    idle timeout, easily reached by a starved server) as a request goes out on it would fail
    that request with "Server disconnected"."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=300),
        connector=aiohttp.TCPConnector(force_close=True),
    )


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
            await wait_idle(session, url)
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
            await wait_idle(session, url)
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
            await wait_idle(session, url)
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


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """vLLM's Prometheus samples, keyed by name plus the labels that matter here."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        key = name
        for label in ("le", "finished_reason"):
            marker = f'{label}="'
            if marker in labels:
                key += f"|{labels.split(marker, 1)[1].split(chr(34), 1)[0]}"
        try:
            samples[key] = samples.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return samples


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def histogram_quantile(
    after: dict[str, float], before: dict[str, float], name: str, q: float
) -> tuple[float, int]:
    """(upper bound of the bucket holding quantile q, sample count) of a histogram's delta."""
    buckets = sorted(
        (float(k.split("|", 1)[1]), delta(after, before, k))
        for k in after
        if k.startswith(f"{name}_bucket|") and not k.endswith("+Inf")
    )
    total = int(delta(after, before, f"{name}_count"))
    if total == 0:
        raise AssertionError(f"no {name} samples")
    for bound, count in buckets:
        if count >= q * total:
            return bound, total
    return float("inf"), total


@dataclass
class ItlOutcome:
    p50: float  # seconds, bucket upper bounds of vLLM's inter-token latency histogram
    p99: float
    samples: int
    longs: list[Completion]
    highs_outlived_window: bool  # the high-tier requests decoded through the whole window


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = await scrape(session, url)
        busy = samples.get(RUNNING, 0.0) + samples.get(WAITING, 0.0)
        if busy == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("vLLM did not become idle")


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
            await wait_idle(session, url)
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
            await _cancel(highs)
            await wait_idle(session, url)
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


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
