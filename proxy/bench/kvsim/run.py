"""One conversation scenario through the proxy's real scheduling (``build_scheduling`` on the
config ``benchmarks/kv_routing.py`` gives the proxy: its queue, tiers, tenants' fairness,
dispatcher, pool and backend chooser, holds included) in front of simulated engines, all on one
simulated clock. Clients are the real benchmark's: closed-loop conversations with think times,
Poisson floods. Each engine's KV events reach its index at the end of the step that made them
(``kv_aware`` only, as in the real benchmark); its load is scraped every ``SCRAPE_S``."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

from proxy.bench.convclient import client_stream
from proxy.bench.conversations import ConversationScenario, ConversationTenant
from proxy.bench.kvbench import proxy_config
from proxy.bench.kvsim.cache import PooledLRU, PrefixCache
from proxy.bench.kvsim.engine import EngineCosts, EngineRequest, SimEngine
from proxy.bench.kvsim.stand_ins import Record, SimIndex, Waiter, note
from proxy.bench.kvsim.workload import Conversation, Prompt, flood_prompt
from proxy.config.loader import parse_config
from proxy.policies.types import QueuedRequest, ScrapedLoad
from proxy.scheduling.build import build_scheduling
from proxy.scheduling.dispatch import Lease
from proxy.scheduling.queue import QueueFull
from proxy.telemetry.metrics import ProxyMetrics

SCRAPE_S = 1.0
DRAIN_S = 120.0  # past the run's end, what is still in flight may finish (else: stuck)
HOLD_SLACK_S = 0.001  # the dispatcher's: past a hold's end before it looks again


@dataclass
class SimRun:
    scenario: ConversationScenario
    policy: str
    records: list[Record] = field(default_factory=list)
    engines: dict[str, SimEngine] = field(default_factory=dict)
    # The floor: what one unbounded cache would compute of the prompts sent (each prompt less
    # its longest prefix sent before), and those prompts' tokens.
    floor: int = 0
    # What one LRU cache the size of all the engines' caches together would compute: the
    # placement's ideal (nothing held twice, nothing moved), the shape's capacity kept.
    pooled_floor: int = 0
    sent: int = 0


def sim_config_urls(n: int) -> list[str]:
    return [f"http://engine-{i}:8000" for i in range(n)]


def simulate(
    scenario: ConversationScenario,
    policy: str,
    *,
    costs: EngineCosts | None = None,
    duration_s: float | None = None,
    replica: int = 0,
) -> SimRun:
    """One run of ``scenario`` under ``policy``. ``replica`` 0 draws the clients' streams as
    the real benchmark's client does (the validation compares them); another draws the same
    shape's clients anew (lengths, think times, flood arrivals), for a larger sample."""
    sim = _Sim(scenario, policy, costs or EngineCosts(), replica)
    return sim.run(duration_s or scenario.duration_s)


class _Sim:
    def __init__(
        self, scenario: ConversationScenario, policy: str, costs: EngineCosts, replica: int = 0
    ) -> None:
        self.scenario, self.policy = scenario, policy
        self.replica = replica
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        urls = sim_config_urls(scenario.engines)
        data = proxy_config(scenario, urls, policy, Path("/dev/null"))
        self.kv = policy.startswith("kv_aware") or policy.endswith("+kv")
        block = scenario.engine.block_size
        if self.kv:
            data["kv_cache"] = {"enabled": True, "block_size": block, "resync_s": 0}
        config = parse_config(yaml.safe_dump(data, sort_keys=False)).config
        self.scheduling = build_scheduling(config, ProxyMetrics(), clock=lambda: self.now)
        self.pool = self.scheduling.pool
        self.dispatcher = self.scheduling.dispatcher
        self.result = SimRun(scenario, policy)
        self._stepping: set[str] = set()
        self._events_out: dict[str, list[tuple[bool, int]]] = {}
        shape = scenario.engine
        for url in urls:
            out: list[tuple[bool, int]] = []
            self._events_out[url] = out
            cache = PrefixCache(
                shape.kv_blocks,
                on_stored=partial(note, out, True),
                on_removed=partial(note, out, False),
            )
            self.result.engines[url] = SimEngine(
                num_blocks=shape.kv_blocks,
                block_size=block,
                max_num_seqs=shape.max_num_seqs,
                max_batched_tokens=shape.max_num_batched_tokens or 2048,
                costs=costs,
                cache=cache,
            )
            if self.kv:
                index = SimIndex(block, 200_000, lambda: self.now, resync_s=0.0)
                index.synced_from_start()
                self.pool.states[url].kv_index = index
        self._output_ids = itertools.count(1)
        self._seen: set[int] = set()
        self._pooled = PooledLRU((shape.kv_blocks - 1) * scenario.engines)

    # -- the clock -----------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, duration_s: float) -> SimRun:
        self.stop_at = duration_s
        for tenant in self.scenario.tenants:
            if tenant.rate_rps > 0:
                rng = self._stream(tenant, "flood")
                self.at(rng.expovariate(tenant.rate_rps), partial(self._flood, tenant, rng))
            for i in range(tenant.conversations):
                self.at(0.0, partial(self._slot, tenant, i))
        self.at(SCRAPE_S, self._scrape)
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        return self.result

    # -- clients -------------------------------------------------------------------------
    def _stream(self, tenant: ConversationTenant, name: str) -> random.Random:
        """A client's seeded stream, the real client's for the same replica."""
        return client_stream(tenant.name, name, self.replica)

    def _slot(self, tenant: ConversationTenant, index: int) -> None:
        rng = self._stream(tenant, str(index))
        conv = Conversation(tenant, self.scenario.engine.block_size, rng)
        self._turn(tenant, conv, rng, 1)

    def _turn(
        self, tenant: ConversationTenant, conv: Conversation, rng: random.Random, n: int
    ) -> None:
        if self.now >= self.stop_at:
            return
        if n > tenant.turns:
            conv = Conversation(tenant, self.scenario.engine.block_size, rng)
            n = 1
        prompt = conv.ask()
        max_tokens = int(rng.uniform(*tenant.max_tokens))

        def after(_: float) -> None:
            conv.answer()
            self.at(
                self.now + rng.uniform(*tenant.think_s),
                lambda: self._turn(tenant, conv, rng, n + 1),
            )

        self._send(tenant, "turn", prompt, max_tokens, after)

    def _flood(self, tenant: ConversationTenant, rng: random.Random) -> None:
        if self.now >= self.stop_at:
            return
        prompt = flood_prompt(tenant, self.scenario.engine.block_size, rng)
        self._send(tenant, "flood", prompt, int(rng.uniform(*tenant.max_tokens)), None)
        self.at(self.now + rng.expovariate(tenant.rate_rps), lambda: self._flood(tenant, rng))

    # -- the proxy -----------------------------------------------------------------------
    def _send(
        self,
        tenant: ConversationTenant,
        kind: str,
        prompt: Prompt,
        max_tokens: int,
        then: Callable[[float], None] | None,
    ) -> None:
        rec = Record(tenant.name, tenant.tier, kind, self.now, prompt.length)
        self.result.records.append(rec)
        self._count_floor(prompt)

        def failed(status: int) -> None:
            rec.status = status
            if then is not None:
                then(self.now)

        req = QueuedRequest(
            tier=tenant.tier,
            tenant=tenant.name,
            prompt_tokens=prompt.length,
            expected_output=max_tokens,
            arrival_s=self.now,
            prefix_hash=prompt.prefix,
            prompt_blocks=prompt.blocks if self.kv else None,
        )
        req.waiter = Waiter(lambda lease: self._start(lease, rec, prompt, max_tokens, then), failed)
        queue = self.scheduling.queue
        try:
            displaced = queue.push(req, self.now)
        except QueueFull:
            failed(429)
            return
        if displaced is not None:
            self.pool.chooser.left(displaced)
            displaced.waiter.set_exception(QueueFull(displaced.tier, 0))
        self._dispatch()

    def _count_floor(self, prompt: Prompt) -> None:
        seen = self._seen
        known = 0
        while known < len(prompt.blocks) and prompt.blocks[known] in seen:
            known += 1
        seen.update(prompt.hashes)
        block = self.scenario.engine.block_size
        self.result.floor += prompt.length - known * block
        pooled = self._pooled.hit_then_note(prompt.blocks, prompt.hashes)
        self.result.pooled_floor += prompt.length - pooled * block
        self.result.sent += prompt.length

    def _dispatch(self) -> None:
        self.dispatcher.dispatch_ready()
        queue = self.scheduling.queue
        if deadline := queue.next_deadline():
            self.at(deadline, self._dispatch_once)
        if len(queue) and self.pool.any_room(self.now):
            ends = self.pool.chooser.next_hold_end(self.now)
            if ends is not None:
                self.at(self.now + ends + HOLD_SLACK_S, self._dispatch_once)

    def _dispatch_once(self) -> None:
        self.dispatcher.dispatch_ready()

    def _start(
        self,
        lease: Lease,
        rec: Record,
        prompt: Prompt,
        max_tokens: int,
        then: Callable[[float], None] | None,
    ) -> None:
        url = lease.backend.cfg.url
        rec.backend = url

        def first(t: float) -> None:
            rec.ttft = t - rec.sent

        def admitted(hit: int) -> None:
            rec.computed = prompt.length - hit

        def done(t: float) -> None:
            rec.status = 200
            lease.release()
            if then is not None:
                then(t)

        engine = self.result.engines[url]
        request = EngineRequest(
            prompt.length,
            prompt.hashes,
            max(1, max_tokens),
            first,
            done,
            output_hash_base=-(next(self._output_ids) << 20),
            on_admitted=admitted,
        )
        if not engine.fits(request):
            rec.status = 400
            lease.release(ran=False)  # the engine refuses it: no trace in the chooser
            if then is not None:
                then(self.now)
            return
        engine.add(request)
        self._kick(url)

    # -- the engines ---------------------------------------------------------------------
    def _kick(self, url: str) -> None:
        if url in self._stepping:
            return
        engine = self.result.engines[url]
        planned = engine.schedule()
        if not planned:
            self._flush(url)
            return
        self._stepping.add(url)
        duration = engine.step_s(planned)
        engine.counts.busy_s += duration

        def end() -> None:
            engine.finish_step(planned, self.now)
            self._stepping.discard(url)  # not before: what finishing starts waits for this
            self._flush(url)
            self._kick(url)

        self.at(self.now + duration, end)

    def _flush(self, url: str) -> None:
        """The step's KV events reach the proxy's index."""
        out = self._events_out[url]
        index = self.pool.states[url].kv_index
        if isinstance(index, SimIndex):
            for stored, block in out:
                if stored:
                    index.put(block)
                else:
                    index.remove([block])
        out.clear()

    def _scrape(self) -> None:
        for url, engine in self.result.engines.items():
            cache = engine.cache
            usage = 1.0 - cache.free / cache.capacity
            self.pool.states[url].load = ScrapedLoad(
                len(engine.waiting),
                len(engine.running),
                usage,
                self.now,
                kv_blocks=cache.capacity,  # vLLM's cache_config_info says its num_gpu_blocks
            )
        busy = any(not e.idle for e in self.result.engines.values())
        if self.now < self.stop_at or (busy and self.now < self.stop_at + DRAIN_S):
            self.at(self.now + SCRAPE_S, self._scrape)
