"""The prompt's tokens from a backend's own ``POST /tokenize``, where no local tokenizer is
configured (``kv_cache.tokenizer`` null): vLLM renders the chat template and tokenizes exactly
as it will for the request. Costs a round trip before the request is queued, so it is bounded:
at most ``kv_cache.max_remote_tokenize`` calls in flight per process, half of them per tenant
(past it, no blocks: the chooser falls back to load, nobody waits), each within
``kv_cache.tokenize_timeout_s``, its answer read up to a cap. A backend that requires the
plugin's ticket on every route refuses these calls (403): no blocks either.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from proxy.backends.counts import TenantCounts
from proxy.backends.pool import BackendPool
from proxy.backends.probes import ProbeFailed, read_capped
from proxy.config.kv_cache import KvCache
from proxy.policies.blockhash import token_ids_ok
from proxy.request.inbound import ParsedRequest
from proxy.request.route_table import ROWS

_CAP_BYTES = 16 * 1024 * 1024  # ~1.5 million token ids


def tokenize_body(parsed: ParsedRequest) -> dict[str, Any] | None:
    """The /tokenize request that gives ``parsed``'s prompt tokens (the route's ``kv_prompt``);
    None when there is none."""
    source = ROWS[parsed.endpoint].kv_prompt
    out = source.remote(parsed.body) if source is not None else None
    if out is not None and parsed.model is not None:
        out["model"] = parsed.model
    return out


class RemoteTokenizer:
    """Round-robin over the available backends that serve the model. One tenant holds at most
    half of ``max_remote_tokenize`` (at least one): a tenant's burst of long prompts held all
    16 calls and the other tenants' turns went without blocks, off their caches (red team)."""

    def __init__(self) -> None:
        self.inflight = 0  # a count, not a semaphore: never waited on
        self.by_tenant = TenantCounts()
        self._turn = 0

    async def tokens(
        self,
        parsed: ParsedRequest,
        kv: KvCache,
        pool: BackendPool,
        session: aiohttp.ClientSession,
        now: float,
        tenant: str = "",
    ) -> list[int] | None:
        body = tokenize_body(parsed)
        if body is None or self.inflight >= kv.max_remote_tokenize:
            return None
        backends = [s for s in pool.all() if s.available(now) and s.serves(parsed.model)]
        if not backends or not self.by_tenant.take(tenant, max(1, kv.max_remote_tokenize // 2)):
            return None
        self._turn += 1
        url = backends[self._turn % len(backends)].cfg.url + "/tokenize"
        self.inflight += 1
        try:
            async with asyncio.timeout(kv.tokenize_timeout_s):
                async with session.post(url, json=body) as resp:
                    if resp.status != 200:
                        return None
                    raw = await read_capped(resp, _CAP_BYTES)
            tokens = orjson.loads(raw).get("tokens")
        except (TimeoutError, aiohttp.ClientError, OSError, ProbeFailed, orjson.JSONDecodeError):
            return None
        except AttributeError:  # not an object
            return None
        finally:
            self.inflight -= 1
            self.by_tenant.give_back(tenant)
        # Out-of-range ids (a bad backend's) would fail the hashing: no blocks, like a client's.
        return tokens if token_ids_ok(tokens) else None
