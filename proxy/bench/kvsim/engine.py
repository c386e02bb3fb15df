"""One engine's batch scheduler, close to vLLM 0.32's (``vllm/v1/core/sched/scheduler.py``):
each step has a token budget (``max_num_batched_tokens``); running requests go first (a decode
takes one token, a prefill the rest of its prompt up to the budget: chunked prefill), then
waiting ones while fewer than ``max_num_seqs`` run, each looked up in the prefix cache on
admission. A request's full blocks are cached as it is scheduled, as vLLM's ``allocate_slots``
caches them, not when the step ends: a request admitted behind it in the same step hits the
blocks that step computes (measured on vLLM 0.32: two requests of one 1,500-token prompt sent
together, a 512-token budget, the second hit 1,408 tokens, more than the two steps before had
computed). When a running request's blocks cannot be allocated, the newest running request is
preempted (its blocks freed, recomputed from scratch later: its prompt and what it generated);
a step that preempted admits nobody. A step lasts ``EngineCosts.step_s`` of what it scheduled.

Counters are vLLM's: prompt tokens once per request, prefix-cache hits at a request's first
admission only (a preempted request's lookups are not counted), so ``prompt - hits`` is what
``benchmarks/kv_routing.py`` reports as computed; ``recomputed`` is the prefill preemption
added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.bench.kvsim.cache import PrefixCache


@dataclass(frozen=True)
class EngineCosts:
    """Seconds a step takes: a fixed part, per prefill token, per decoding request. The default
    is vLLM's CPU engine with the tiny model on one core of a quiet machine (~10k prefill
    tokens/s, a step of a few decoding requests in ~5 ms: the simulator then sends the shipped
    ``prefix-cache`` scenario's 1,077 requests where real runs sent 1,077-1,099); ``BUSY`` is the
    same engine beside the test suite on this 2-core machine, measured on the real runs of
    docs/benchmarks.md's validation (2-4k prefill tokens/s, ~35 ms a decode step)."""

    step: float = 0.004
    prefill_token: float = 0.0001
    decode_seq: float = 0.0003

    def step_s(self, prefill_tokens: int, decodes: int) -> float:
        return self.step + self.prefill_token * prefill_tokens + self.decode_seq * decodes


BUSY = EngineCosts(step=0.03, prefill_token=0.00025, decode_seq=0.002)
COSTS = {"quiet": EngineCosts(), "busy": BUSY}


@dataclass(eq=False)
class EngineRequest:
    prompt_len: int
    hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    max_tokens: int
    on_first_token: Callable[[float], None]
    on_done: Callable[[float], None]
    blocks: list[int | None] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is computed (or reused)
    output: int = 0
    preemptions: int = 0
    first_token_at: float | None = None
    output_hash_base: int = 0  # unique hashes for the blocks its output fills
    cached_upto: int = 0  # its blocks before this one are cached (or duplicates)
    # Called once, at its first admission, with the tokens its prefix hit saved.
    on_admitted: Callable[[int], None] | None = None

    @property
    def tokens(self) -> int:
        """Prompt and generated tokens: what a (re)computation has to reach."""
        return self.prompt_len + self.output

    def block_hash(self, index: int) -> int:
        if index < len(self.hashes):
            return self.hashes[index]
        return self.output_hash_base + index


@dataclass
class EngineCounts:
    prompt: int = 0
    hits: int = 0
    recomputed: int = 0
    preemptions: int = 0
    requests: int = 0
    busy_s: float = 0.0


class SimEngine:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        costs: EngineCosts,
        cache: PrefixCache | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.costs = costs
        self.cache = cache or PrefixCache(num_blocks)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.counts = EngineCounts()

    def fits(self, request: EngineRequest) -> bool:
        """Whether the whole request can ever be held (else vLLM would wait on it forever;
        the simulator refuses it)."""
        return self._blocks_for(request.prompt_len + request.max_tokens) <= self.cache.capacity

    def add(self, request: EngineRequest) -> None:
        self.counts.prompt += request.prompt_len
        self.counts.requests += 1
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> dict[EngineRequest, int]:
        """One step's tokens per request (blocks allocated and cached as vLLM does at
        scheduling); empty: nothing can run."""
        budget = self.max_batched_tokens
        planned: dict[EngineRequest, int] = {}
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.tokens - req.computed, budget)
            while not self._grow(req, n):
                victim = self.running.pop()  # the newest (vLLM's FCFS policy)
                self._preempt(victim)
                budget += planned.pop(victim, 0)
                preempted = True
                if victim is req:
                    break
            if req in self.running:
                planned[req] = n
                budget -= n
                self._cache_full(req, req.computed + n)
                i += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            if budget <= 0:
                break
            req = self.waiting[0]
            max_hit = (req.tokens - 1) // self.block_size
            hit = self.cache.hit(req.hashes, max_hit)
            n = min(req.tokens - hit * self.block_size, budget)
            if not self._admit(req, hit, n):
                break
            self.waiting.popleft()
            self.running.append(req)
            planned[req] = n
            budget -= n
            self._cache_full(req, req.computed + n)
        return planned

    def finish_step(self, planned: dict[EngineRequest, int], now: float) -> None:
        """The step scheduled by ``schedule`` ends at ``now``."""
        for req, n in planned.items():
            req.computed += n
            if req.computed < req.tokens:
                continue  # a prefill chunk
            req.output += 1
            if req.first_token_at is None:
                req.first_token_at = now
                req.on_first_token(now)
            if req.output >= req.max_tokens:
                self.running.remove(req)
                self.cache.release(req.blocks)
                req.on_done(now)

    def step_s(self, planned: dict[EngineRequest, int]) -> float:
        """How long the step ``schedule`` planned lasts (called before ``finish_step``)."""
        decodes = sum(1 for r in planned if r.computed >= r.prompt_len)
        prefill = sum(n for r, n in planned.items() if r.computed < r.prompt_len)
        return self.costs.step_s(prefill, decodes)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _grow(self, req: EngineRequest, n: int) -> bool:
        new = self._blocks_for(req.computed + n) - len(req.blocks)
        return new <= 0 or self.cache.allocate(req.blocks, (), new)

    def _admit(self, req: EngineRequest, hit: int, n: int) -> bool:
        hits = req.hashes[:hit]
        new = self._blocks_for(hit * self.block_size + n) - hit
        if not self.cache.allocate(req.blocks, hits, max(0, new)):
            return False
        if req.preemptions:
            self.counts.recomputed += req.tokens - hit * self.block_size
        else:
            self.counts.hits += hit * self.block_size
            if req.on_admitted is not None:
                req.on_admitted(hit * self.block_size)
        req.computed = hit * self.block_size
        return True

    def _preempt(self, req: EngineRequest) -> None:
        self.cache.release(req.blocks)
        req.computed = 0
        req.cached_upto = 0
        req.preemptions += 1
        self.counts.preemptions += 1
        self.waiting.appendleft(req)

    def _cache_full(self, req: EngineRequest, upto: int) -> None:
        full = upto // self.block_size
        for i in range(req.cached_upto, full):
            self.cache.cache_block(req.blocks, i, req.block_hash(i))
        req.cached_upto = max(req.cached_upto, full)
