"""``backends: kv_aware``'s cost model: the prefill queued ahead of a request on each backend,
in tokens, from what the chooser sent there and what the backend's KV-cache index shows done
(docs in ``proxy.policies.kvaware``).

A request sent to a backend adds the prompt tokens it has to prefill there (its prompt less the
prefix the chooser counted as cached for it). That work is ahead of a new prompt only until it
is computed: the engine stores a prompt's full blocks as it prefills them, so the index, fed by
its KV events, shows how far each prefill has gone; a request whose every full block is there
is decoding. A decoding request delays a new prefill by a share of each step (vLLM batches one
token per running request with the prefill chunks), not by the tokens it has left to generate:
it counts ``DECODE_TOKENS``, whatever its ``max_tokens``. Counts of requests would weigh a
4,000-token prefill like a 50-token one; tokens until the request ends would weigh a long
answer's decode like a prefill ahead.

Without an index (cold, or none), a request's prefill counts until it ends: the proxy cannot see
it done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.policies.types import BackendView, QueuedRequest

# A decoding request's cost to a new prompt's time to first token, in prefill tokens: a step
# computes one token per running request beside the prefill chunks (vLLM's CPU engine: ~0.3 ms
# a running request against ~0.1 ms a prefill token, a prefill of a few steps).
DECODE_TOKENS = 8.0


@dataclass(slots=True)
class _Job:
    url: str
    blocks: Sequence[int]  # the prompt's full blocks (empty: not known)
    done: int  # leading blocks known computed there (cached at dispatch, or indexed since)
    start: int  # the blocks counted as cached at dispatch
    prefill: float  # the tokens it had to prefill there at dispatch


class WorkAhead:
    """Per backend, the prefill sent there that is not done, in tokens."""

    def __init__(self, block_size: int, decode_tokens: float = DECODE_TOKENS) -> None:
        self.block_size = block_size
        self.decode_tokens = decode_tokens
        self._jobs: dict[int, _Job] = {}  # id(request) -> where it went, how far it is
        self._by_url: dict[str, dict[int, _Job]] = {}

    def sent(
        self,
        request: QueuedRequest,
        url: str,
        prefill_tokens: int,
        blocks: Sequence[int] = (),
        cached_blocks: int = 0,
    ) -> None:
        """``request`` went to ``url`` with ``prefill_tokens`` of its prompt to compute, the
        first ``cached_blocks`` of its ``blocks`` counted as cached there."""
        self.ended(request)  # sent again (a retry): counted once, where it went last
        start = min(cached_blocks, len(blocks))
        job = _Job(url, blocks, start, start, float(max(0, prefill_tokens)))
        self._jobs[id(request)] = job
        self._by_url.setdefault(url, {})[id(request)] = job

    def ended(self, request: QueuedRequest) -> None:
        """``request`` ended (ran, failed or left): no longer ahead of anyone."""
        job = self._jobs.pop(id(request), None)
        if job is not None:
            jobs = self._by_url[job.url]
            del jobs[id(request)]
            if not jobs:
                del self._by_url[job.url]

    def of(self, state: BackendView) -> float:
        """The prefill tokens queued or running on ``state`` from this chooser that its index
        does not show done, and ``decode_tokens`` per request decoding there (0: none)."""
        jobs = self._by_url.get(state.cfg.url)
        if not jobs:
            return 0.0
        return sum(self._left(job, state) for job in jobs.values())

    def _left(self, job: _Job, state: BackendView) -> float:
        blocks = job.blocks
        if blocks and job.done < len(blocks):
            more = state.cached_blocks(blocks[job.done :])  # None: no index, or a cold one
            if more:
                job.done += more
        if blocks and job.done >= len(blocks):
            return self.decode_tokens  # every full block stored: prefilled, decoding
        computed = (job.done - job.start) * self.block_size
        return max(0.0, job.prefill - computed) + self.decode_tokens
