"""The client's headers that go on to the backend: never the hop-by-hop or proxy-owned ones,
never ``X-Vllm-*`` / ``X-Tierproxy-*`` (no client sets its priority; only the proxy's signed
ticket decides), those that steer vLLM's engine only where ``input.forward_headers`` names them."""

from __future__ import annotations

from collections.abc import Collection

from multidict import CIMultiDict, CIMultiDictProxy

STRIPPED_HEADER_PREFIXES = ("x-vllm-", "x-tierproxy-")
# Hop-by-hop headers (RFC 9110 §7.6.1, plus the obsolete Proxy-Connection); those the Connection
# header names are dropped as well.
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded, whatever the config says: credentials, what the proxy sets or rewrites itself
# (the body goes on as identity JSON of its own length), and Expect (the proxy has the whole body;
# a 100-continue towards the backend would only stall).
NEVER_FORWARDED = HOP_BY_HOP_HEADERS | {
    "authorization",
    "api-key",
    "proxy-authorization",
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "accept-encoding",
    "x-request-id",
    "expect",
}
# Dropped unless input.forward_headers names them: the client's cookies, and headers that steer
# vLLM's engine (its data-parallel rank, its session routing).
DROPPED_BY_DEFAULT = frozenset({"cookie", "x-data-parallel-rank", "x-session-id"})


def upstream_headers(
    client_headers: CIMultiDictProxy[str], forward: Collection[str] = ()
) -> CIMultiDict[str]:
    """The client's headers that go on to the backend; ``forward`` (input.forward_headers)
    lets through those dropped by default, never the hop-by-hop or proxy-owned ones."""
    allowed = {name.lower() for name in forward} - NEVER_FORWARDED
    named_by_connection = {
        token.strip().lower()
        for value in client_headers.getall("Connection", [])
        for token in value.split(",")
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client_headers.items():
        lower = name.lower()
        if lower.startswith(STRIPPED_HEADER_PREFIXES) or lower in named_by_connection:
            continue
        if lower in NEVER_FORWARDED or (lower in DROPPED_BY_DEFAULT and lower not in allowed):
            continue
        out.add(name, value)
    return out
