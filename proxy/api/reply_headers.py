"""Headers the proxy adds to its answers: the request id, OpenAI's ``x-ratelimit-*`` and
``x-should-retry``.

Every request gets the proxy's own id (``new_request_id``: 128 random bits): the one sent to
vLLM, bound into the ticket, in the usage log's record and the access log. A client's own
``X-Request-Id``, when short and plain, is echoed back to it and logged beside the proxy's id,
never used as a key (two tenants may send the same one, or guess another's); anything else is
ignored, so that no client can put control characters or megabytes into logs and headers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from proxy.api.hotpath import new_request_id

REQUEST_ID_MAX_CHARS = 128
_SAFE_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{REQUEST_ID_MAX_CHARS}}}")

# Answers that the same request cannot change by retrying: the OpenAI SDKs obey
# ``x-should-retry: false`` over their own rule (which would retry 408, 409, 429 and 5xx).
NO_RETRY_STATUSES = frozenset({400, 401, 403, 404, 405, 413, 415, 422})


@dataclass(frozen=True)
class BucketWindow:
    """One rate limit as OpenAI's ``x-ratelimit-*`` headers tell it (``proxy.scheduling.limits``
    fills it from a tenant's token bucket)."""

    limit: float
    remaining: float  # below zero while a tenant pays off usage past its reservation
    reset_s: float  # until the bucket is full again


# The id every answer to a request carries: the client's X-Request-Id echoed, else the proxy's.
REQUEST_ID = web.RequestKey("tierproxy_request_id", str)
# The x-ratelimit-* headers as they stood when the request was admitted: a stream's headers
# leave with its first event, before the request ends (``add_admitted_limits``).
ADMITTED_LIMITS = web.RequestKey("tierproxy_admitted_limits", dict[str, str])


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: X-Request-Id on every answer, streams and errors included."""
    if "X-Request-Id" not in response.headers:
        chosen = request.get(REQUEST_ID)
        response.headers["X-Request-Id"] = chosen or request_id_for(request.headers)


async def add_admitted_limits(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the x-ratelimit-* headers known at admission on every answer to
    an admitted request that has none of its own (a stream; a buffered answer while Redis
    decides the limits), streams of every route included."""
    for name, value in request.get(ADMITTED_LIMITS, {}).items():
        response.headers.setdefault(name, value)


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's X-Request-Id when well-formed (to echo and log, never a key), else None."""
    theirs = headers.get("X-Request-Id")
    if theirs and _SAFE_REQUEST_ID.fullmatch(theirs):
        return theirs
    return None


def request_id_for(headers: Mapping[str, str]) -> str:
    """The id to answer with: the client's X-Request-Id when well-formed, else a fresh one."""
    return client_request_id(headers) or new_request_id()


def should_retry_header(status: int, *, execution_timeout: bool = False) -> dict[str, str]:
    """``x-should-retry: false`` on answers a retry cannot fix: client errors, and a 504 after
    the request ran its whole time limit (a retry would run it, and time out, again)."""
    if status in NO_RETRY_STATUSES or execution_timeout:
        return {"x-should-retry": "false"}
    return {}


def ratelimit_headers(windows: Mapping[str, BucketWindow]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits the
    tenant has (none for those it has not)."""
    out: dict[str, str] = {}
    for name, window in windows.items():
        if not all(map(math.isfinite, (window.limit, window.remaining, window.reset_s))):
            continue  # no header rather than a made-up figure
        out[f"x-ratelimit-limit-{name}"] = str(int(window.limit))
        out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(window.remaining)))
        out[f"x-ratelimit-reset-{name}"] = openai_duration(window.reset_s)
    return out


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI writes it in these headers: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    whole_minutes, secs = divmod(seconds, 60.0)
    hours, minutes = divmod(int(whole_minutes), 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text
