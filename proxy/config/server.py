"""The config sections about serving clients: listeners, connections, what a client may send,
and the bounds on relaying answers back (issue #12). Read at start unless a field says so."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.base import TUNING, Strict


class Listen(Strict):
    """Where clients reach the proxy (also /metrics and /admin unless `admin_listen` is set)."""

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 for every interface.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")


class AdminListen(Strict):
    """A second listener that alone serves /metrics and /admin (keep it off public networks)."""

    host: str = Field("127.0.0.1", description="Address to bind (keep it loopback or private).")
    port: int = Field(ge=0, le=65535, description="TCP port; must differ from `listen.port`.")


class Server(Strict):
    """Client connections (like nginx's worker_connections and client_header/keepalive timeouts).
    Read at start: a change needs a restart."""

    max_connections: int = Field(
        4096,
        gt=0,
        description="Open client connections on all listeners together; beyond it a new"
        " connection gets a canned 503 JSON with Retry-After and is closed before anything"
        " is parsed (unless `evict_at_cap` makes room for it). With `serve --workers N`: the"
        " port's total, divided among the workers.",
    )
    evict_at_cap: bool = Field(
        True,
        description="At `max_connections`, close the oldest connection that has not yet sent"
        " a whole request head (a canned 503 too_many_connections) to make room for the new"
        " one, which is refused only when no such connection is left. A client holding every"
        " slot with half-sent heads then locks nobody out; a connection whose request is in"
        " progress (body, queue, answer) is never cut. `false`: the newcomer is refused.",
        json_schema_extra=TUNING,
    )
    max_connections_per_address: int | None = Field(
        None,
        gt=0,
        description="Open connections one client address may hold (IPv4/IPv6 peer address, as"
        " the proxy sees it); past it a new one from that address gets the canned 503"
        " too_many_connections and is closed. Unset (default): no share, because clients"
        " behind one NAT, proxy or load balancer reach the proxy from one address: set it"
        " only where clients connect directly, above what one real client needs.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request's headers must be complete this long after its first byte (or"
        " after the connection opened); else 408 JSON and the connection closes (slowloris)."
        " Each connection's timer falls in the last quarter of it, so that connections opened"
        " in one burst do not all close in the same instant.",
    )
    keepalive_timeout_s: float = Field(
        15.0, gt=0, description="An idle connection (no request in progress) closes after this."
    )
    admin_connections: int = Field(
        64,
        gt=0,
        description="Connections of the admin listener's own (`admin_listen`), apart from"
        " `max_connections`: /metrics, /admin and drain answer while the public listener is"
        " flooded. Without `admin_listen` they share the public listener's cap.",
        json_schema_extra=TUNING,
    )
    # nginx reads a request head into at most 4 x 8 KiB buffers (large_client_header_buffers);
    # Envoy's max_request_headers_kb defaults to 60 KiB.
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description="A request's line and headers together, in bytes; past it 431 JSON and the"
        " connection closes (before the headers end: they are never parsed whole). Each line"
        " is also bounded by aiohttp's parser (8,190 bytes; 128 fields).",
    )
    max_pending_header_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Bytes of request heads received but not yet complete, on all connections"
        " together (the parser keeps them while it waits for the blank line that ends them);"
        " a connection whose head would pass it gets 503 JSON (`header_memory_full`, Retry-After)"
        " and closes. With `max_header_bytes` it bounds what clients that never finish their"
        " headers hold, however many connections they open. A head that arrives whole in one"
        " read (almost every real client's) is never counted.",
        json_schema_extra=TUNING,
    )
    reload_debounce_s: float = Field(
        0.2,
        ge=0,
        description="Live reload: a changed file is applied only when it reads the same again"
        " this long after (a file saved in two writes is never applied half-written).",
        json_schema_extra=TUNING,
    )


class Relay(Strict):
    """Bounds on relaying an answer: how long a client may stall, how much is held per request,
    how often a request that may have run is retried."""

    send_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A write to the client that makes no progress this long (the client"
        " stopped reading) ends the request: the upstream is closed and the backend slot freed"
        " (a stream whose backend already ended within `read_ahead_bytes` freed it then).",
    )
    # A chat stream's event is ~250 bytes a token: 256 KiB holds the rest of a ~1,000-token
    # answer (~100 tokens with top-20 logprobs), so most answers end upstream while their client
    # lags. A connection holds 64 KiB unsent without it (asyncio's high-water mark); 4,096
    # lagging connections x 256 KiB would be 1 GiB, so each reserves it from
    # `limits.max_held_bytes`, within half of it (past that a stream lags as it did before).
    read_ahead_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Bytes of a streamed answer held for a client that reads slower than the"
        " backend writes (its connection's unsent bytes), so that the backend's answer is read"
        " to its end and its slot and tokens are handed on while the rest drains under"
        " `send_idle_timeout_s`. Reserved from `limits.max_held_bytes`, within half of it;"
        " 0 (or up to 64 KiB, what a connection holds anyway): none, the backend's room held"
        " until the client has read all but that.",
    )
    # vLLM's chunks are a few KB even with top-20 logprobs; aiohttp used to fail lines > 2 MiB.
    max_event_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="One SSE event held at most: past it, an error event and [DONE], or 502"
        " before any byte reached the client.",
        json_schema_extra=TUNING,
    )
    buffer_response_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="A non-stream answer up to this size is held whole (usage read, retry still"
        " possible); a larger one is streamed through to the client in chunks.",
        json_schema_extra=TUNING,
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="A non-stream answer larger than this is refused (502 when its length is"
        " announced, a cut connection when it passes the limit while being relayed).",
    )
    oversize_scan_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="An answer past max_response_bytes was computed whole by the engine: it is"
        " read on this far (never held, never relayed; within the execution timeout) for its"
        " usage, which is billed. Without it, the request is billed its reservation.",
        json_schema_extra=TUNING,
    )
    max_reset_retries: int = Field(
        1,
        ge=0,
        description="Retries of a request after a backend reset it (or answered invalid HTTP):"
        " it may have run there. Past this, the request is a poison pill: 502.",
        json_schema_extra=TUNING,
    )


class InputLimits(Strict):
    """What the proxy accepts from a client before anything is queued (issue #12)."""

    # At most 128: the proxy re-serialises bodies with orjson, which cannot write > 255 levels.
    max_json_depth: int = Field(
        64,
        ge=2,
        le=128,
        description="Deepest nesting of arrays and objects in a body (the body itself is depth"
        " 1); deeper bodies get 400 at parse time.",
        json_schema_extra=TUNING,
    )
    # Every value parsed is walked in Python on the event loop (validation, the token estimate):
    # ~0.2 µs a scalar, ~1 µs an object or array. Bodies of tiny containers ([{},{},...]: one per
    # 3 bytes) froze the loop for seconds; these bound that work to ~0.35 s per body.
    max_json_elements: int = Field(
        1_048_576,
        ge=1,
        description="Most values (strings, numbers, arrays, objects ...) inside a body's arrays"
        " and objects, at every level; past it 400 `json_too_many_elements` at parse time"
        " (a prompt of a million token ids fits).",
        json_schema_extra=TUNING,
    )
    max_json_containers: int = Field(
        100_000,
        ge=1,
        description="Most arrays and objects in a body, at every level; past it 400"
        " `json_too_many_elements` at parse time (10,000 chat messages with content parts"
        " take ~50,000).",
        json_schema_extra=TUNING,
    )
    max_tokens_per_media_item: int = Field(
        16_384,
        ge=1,
        description="What one image, audio or video part of a prompt is reserved against quotas"
        " and budgets, in tokens, in place of its bytes (docs/quotas.md, the prompt's upper"
        " bound). The default covers common vision models (Qwen2-VL at its default maximum"
        " resolution: 16,384; LLaVA: 576 to 2,880); set your model's maximum per item.",
        json_schema_extra=TUNING,
    )
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A body not received in full within this many seconds gets 408"
        " (slow-body clients).",
    )
    max_uploads_per_tenant: int | None = Field(
        None,
        ge=1,
        description="Request bodies one tenant may have coming in at once (counted once its"
        " key is checked, before its rate limits, which need the body); past it 429"
        " `too_many_uploads` and the connection closes unread. Unset: a quarter of"
        " `server.max_connections`, so that one tenant's slow uploads (a request in progress"
        " is never evicted) cannot hold every connection.",
    )
    decode_content_encodings: list[Literal["gzip", "deflate"]] = Field(
        default_factory=lambda: list[Literal["gzip", "deflate"]](["gzip", "deflate"]),
        description="Request Content-Encodings the proxy decodes itself, the decoded size"
        " bounded by `limits.max_body_bytes` (413 past it; more than 16 gzip members: 400);"
        " any other encoding gets 415. The backend always gets the body as identity JSON,"
        " without a Content-Encoding header.",
    )
    forward_headers: list[str] = Field(
        default_factory=list,
        description="Client headers forwarded although the proxy would drop them (e.g."
        ' "Cookie", "X-data-parallel-rank"); case-insensitive. Hop-by-hop headers, credentials'
        " and X-Vllm-* / X-Tierproxy-* are never forwarded, whatever this says.",
    )
