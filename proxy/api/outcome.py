"""How a request ended: one word for the access log, the ``outcome`` metric label and the relay.

The values are the label values of ``tierproxy_requests_total``; dashboards and tests match
them, so they never change. A ``StrEnum``, so that ``str()`` (what prometheus_client and
``%s`` use) gives the bare value.
"""

from __future__ import annotations

from enum import StrEnum

from proxy.api.errors import ProxyError


class Outcome(StrEnum):
    OK = "ok"
    CLIENT_GONE = "client_gone"  # the client left before the end
    TIMEOUT = "timeout"  # the tier's request timeout ran out
    QUEUE_FULL = "queue_full"
    REFUSED_EARLY = "refused_early"  # its predicted wait exceeded the tier's queue timeout
    RATE_LIMITED = "rate_limited"  # a tenant limit said no
    QUEUE_TIMEOUT = "queue_timeout"  # waited the tier's queue timeout without a backend
    UNAUTHORIZED = "unauthorized"
    REJECTED = "rejected"  # the proxy refused the input (4xx of its own)
    UNAVAILABLE = "unavailable"  # no backend could take it (503 of the proxy's own)
    BACKEND_ERROR = "backend_error"  # the backend answered 5xx
    UPSTREAM_ERROR = "upstream_error"  # the backend failed: reset, invalid or oversize answer
    CLIENT_ERROR = "client_error"  # the backend answered 4xx
    CLIENT_STALLED = "client_stalled"  # the client stopped reading: cut at the send timeout
    ERROR = "error"  # anything else: a bug


# The proxy's own 502s for backends that broke (an ``upstream_error`` of its own stays ``error``).
BACKEND_FAULT_CODES = frozenset(
    {"upstream_reset", "upstream_too_large", "backends_failed", "engine_dead"}
)


def outcome_of(err: ProxyError) -> Outcome:
    """The outcome of a request that ended in one of the proxy's own errors."""
    if err.status == 401:
        return Outcome.UNAUTHORIZED
    if err.status == 413:
        return Outcome.REJECTED
    if err.status == 429:
        if err.code == "predicted_wait_too_long":
            return Outcome.REFUSED_EARLY
        return Outcome.QUEUE_FULL if err.code == "queue_full" else Outcome.RATE_LIMITED
    if err.status == 503:
        return Outcome.QUEUE_TIMEOUT if err.code == "queue_timeout" else Outcome.UNAVAILABLE
    if err.code in BACKEND_FAULT_CODES:
        return Outcome.UPSTREAM_ERROR
    if err.status == 504:
        return Outcome.TIMEOUT
    return Outcome.REJECTED if err.status < 500 else Outcome.ERROR
