"""What the proxy sends a backend: the body it decided on, the signed ticket bound to it, and
the client's headers that may pass (``proxy.request.inbound.upstream_headers``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from proxy.config.schema import Config
from proxy.relay.budget import MemoryBudget
from proxy.relay.delivered import Delivered
from proxy.relay.forward import UpstreamCall
from proxy.request.headers import upstream_headers
from proxy.request.inbound import ParsedRequest
from proxy.request.route_table import ROWS
from proxy.scheduling.dispatch import CheapLease, Lease
from proxy.ticket import (
    CONTENT_DIGEST_HEADER,
    REQUEST_ID_HEADER,
    TICKET_HEADER,
    Ticket,
    body_digest,
    encode_ticket,
    new_nonce,
)

# W3C trace context: with tracing on, the proxy's own span is vLLM's parent.
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")


def upstream_call(
    config: Config,
    parsed: ParsedRequest,
    *,
    tier_name: str,
    tenant: str,
    request_id: str,
    lease: Lease | CheapLease,
    client_headers: CIMultiDictProxy[str],
    secret: bytes,
    session: aiohttp.ClientSession,
    budget: MemoryBudget | None = None,
    delivered: Delivered | None = None,
    cache_salt: str = "",
    reply_request_id: str | None = None,
    trace_headers: Mapping[str, str] | None = None,
) -> UpstreamCall:
    """One attempt's call under ``lease``: a fresh ticket each time (a nonce is good for one
    use), stamped on the backend's clock where measured (``BackendState.ticket_time_correction``),
    so that its plugin's window check sees ``issued_at`` on its own clock; the lease is released
    as soon as the backend is done with the answer (``UpstreamCall.release_backend``), which may
    be before its client has read it all. ``cache_salt``: the tenant's prefix-cache salt, put
    into the body (every model route of vLLM 0.32 takes one) and bound into the ticket ("": none).
    ``reply_request_id``: the X-Request-Id the client's answer carries (its own echoed), where
    it differs from ``request_id``, the proxy's, which vLLM gets. ``trace_headers``: the
    upstream span's ``traceparent``/``tracestate`` where tracing is on, in place of the
    client's (None: the client's pass on as they came)."""
    tier, backend = config.tiers[tier_name], lease.backend.cfg
    body = dict(parsed.body)
    if backend.send_priority:
        body["priority"] = tier.priority
    if cache_salt:
        body["cache_salt"] = cache_salt
    if ROWS[parsed.endpoint].proxy_request_id:  # vLLM's own id on /v1/responses
        body["request_id"] = request_id
    payload = orjson.dumps(body)
    # Bound to these exact bytes, this request id and a fresh nonce: one use, for a moment.
    now = time.time() + lease.backend.ticket_time_correction
    digest = body_digest(payload)
    ticket = Ticket(
        tier=tier_name,
        priority=tier.priority,
        tenant=tenant,
        deadline=now + tier.request_timeout_s,
        prefill_share=config.prefill_share(tier_name),
        budget=parsed.max_tokens or config.limits.max_tokens_ceiling,
        request_id=request_id,
        body_sha256=digest,
        issued_at=now,
        nonce=new_nonce(),
        cache_salt=cache_salt,
    )
    headers = upstream_headers(client_headers, forward=config.input.forward_headers)
    if trace_headers is not None:
        for name in TRACE_CONTEXT_HEADERS:
            headers.popall(name, None)
        headers.update(trace_headers)
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"  # relayed undecoded: never ask for gzip
    headers[REQUEST_ID_HEADER] = request_id
    headers[CONTENT_DIGEST_HEADER] = f"sha-256=:{digest}:"  # content_digest(), hashed once
    headers[TICKET_HEADER] = encode_ticket(ticket, secret)
    return UpstreamCall(
        session=session,
        url=backend.url + parsed.upstream_path,
        body=payload,
        headers=headers,
        deadline=asyncio.get_running_loop().time() + tier.request_timeout_s,
        timeout_s=tier.request_timeout_s,
        strip_usage_chunk=parsed.stream and not parsed.client_wants_usage,
        bounds=config.relay,
        budget=budget,
        delivered=delivered if delivered is not None else Delivered(),
        reply_request_id=reply_request_id,
        release_backend=lambda ran: lease.release(ran=ran),
    )
