"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import orjson
from aiohttp import web

from proxy.api.reply_headers import should_retry_header
from proxy.api.routes import served_paths_text


class ProxyError(Exception):
    """An answer to the client that is not the backend's: status, OpenAI error body, headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        retryable: bool | None = None,  # None: as the status says (should_retry_header)
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        if self.retryable is False:
            headers = {"x-should-retry": "false"}
        else:
            headers = should_retry_header(
                self.status, execution_timeout=self.code == "request_timeout"
            )
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=self.headers(),
        )

    def sse_event(self) -> bytes:
        """The error as it appears inside a stream, followed by the stream's end."""
        return b"data: " + orjson.dumps(self.body()) + b"\n\ndata: [DONE]\n\n"


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413, f"The request body is larger than {limit} bytes.", code="request_too_large"
    )


def model_not_found(model: str | None, served: list[str] | None = None) -> ProxyError:
    """vLLM's message, with its list of the names that are served; a name past 256
    characters is cut short (a client's megabyte of name is not echoed back whole)."""
    hint = f" Valid aliases: {', '.join(served)}." if served else ""
    shown = model if model is None or len(model) <= 256 else f"{model[:256]}..."
    return ProxyError(
        404,
        f"The model `{shown}` does not exist.{hint}",
        param="model",
        code="model_not_found",
    )


def unknown_url(method: str, path: str) -> ProxyError:
    return ProxyError(
        404,
        f"{method} {path} is not served by tierproxy; it serves {served_paths_text()}.",
        code="unknown_url",
    )


def method_not_allowed(method: str, path: str, allowed: str) -> ProxyError:
    """vLLM's 405 for a wrong method on one of its routes (the caller adds ``Allow``)."""
    return ProxyError(
        405, f"{method} {path}: method not allowed; use {allowed}.", code="method_not_allowed"
    )


def admin_disabled() -> ProxyError:
    return ProxyError(
        404, "The admin API is off (no admin_keys in the config).", code="admin_disabled"
    )


def metrics_private() -> ProxyError:
    """/metrics on the client listener with no admin key to read it with."""
    return ProxyError(
        404,
        "/metrics names every tenant's usage: serve it on admin_listen, or configure admin_keys"
        " and scrape it with one as a bearer token.",
        code="admin_disabled",
    )


def unknown_backend(url: str) -> ProxyError:
    return ProxyError(404, f"No backend {url!r}", code="unknown_backend")


def unauthorized() -> ProxyError:
    return ProxyError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
        type="authentication_error",
        code="invalid_api_key",
    )


def key_expired(expired_at: float) -> ProxyError:
    """A configured key past its ``expires_at``: says when, and nothing about other keys."""
    when = datetime.fromtimestamp(expired_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ProxyError(
        401,
        f"API key expired at {when}. Ask your administrator for a new key.",
        type="authentication_error",
        code="expired_api_key",
    )


def queue_full(tier: str, retry_after_s: float, *, displaced: bool = False) -> ProxyError:
    why = " and your tenant held the largest share of it" if displaced else ""
    return ProxyError(
        429,
        f"The {tier} tier's queue is full{why}; retry later.",
        type="rate_limit_error",
        code="queue_full",
        retry_after_s=retry_after_s,
    )


def rate_limited(what: str, retry_after_s: float) -> ProxyError:
    return ProxyError(
        429,
        f"Rate limit reached for your key ({what}); retry after the indicated time.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=retry_after_s,
    )


def over_token_limit(limit: float, requested: float) -> ProxyError:
    """A request whose token estimate exceeds the tenant's whole tokens_per_minute: no wait
    makes it fit, so 429 with ``x-should-retry: false`` and no Retry-After (OpenAI answers
    "Request too large ... on tokens per min" with a 429 too)."""
    return ProxyError(
        429,
        f"Request too large for your key's tokens_per_minute: limit {limit:.0f}, requested about"
        f" {requested:.0f} (the prompt's estimate plus max_tokens for each of n choices and"
        " each prompt). Lower max_tokens, n or the number of prompts; waiting will not help.",
        type="rate_limit_error",
        code="request_over_token_limit",
        param="max_tokens",
        retryable=False,
    )


def queue_timeout(tier: str, waited_s: float, retry_after_s: float) -> ProxyError:
    return ProxyError(
        503,
        f"The request waited {waited_s:.1f}s in the {tier} tier's queue without a free backend;"
        " the service is overloaded, retry later.",
        type="server_error",
        code="queue_timeout",
        retry_after_s=retry_after_s,
    )


def adapter_load_failed(adapter: str, reason: str, retry_after_s: float = 1.0) -> ProxyError:
    """``retry_after_s``: the rest of a failed load's hold, when the load is held back."""
    return ProxyError(
        503,
        f"The adapter `{adapter}` could not be loaded ({reason}); retry later.",
        type="server_error",
        code="adapter_load_failed",
        param="model",
        retry_after_s=retry_after_s,
    )


def execution_timeout(limit_s: float) -> ProxyError:
    return ProxyError(
        504,
        f"The request did not finish within its tier's limit of {limit_s:g}s.",
        type="server_error",
        code="request_timeout",
    )


def no_backend(message: str) -> ProxyError:
    return ProxyError(
        503, message, type="server_error", code="backend_unavailable", retry_after_s=1
    )


def cheap_busy() -> ProxyError:
    """Every backend runs its cap of tokenizer calls (``backends[].max_cheap_inflight``)."""
    return ProxyError(
        503,
        "Every backend is running its cap of tokenizer calls; retry shortly.",
        type="server_error",
        code="backend_busy",
        retry_after_s=1,
    )


def backend_overloaded() -> ProxyError:
    """Every attempt met a backend answering 503 (vLLM's own overload answer)."""
    return ProxyError(
        503,
        "Every backend tried is overloaded; retry later.",
        type="server_error",
        code="backend_overloaded",
        retry_after_s=1,
    )


def config_changed() -> ProxyError:
    """A reload removed the request's tier between its admission and its queueing."""
    return ProxyError(
        503,
        "The service's configuration changed; retry.",
        type="server_error",
        code="config_changed",
        retry_after_s=1,
    )


def upstream_failed(message: str) -> ProxyError:
    return ProxyError(502, message, type="server_error", code="upstream_error")


def internal_error() -> ProxyError:
    return ProxyError(
        500,
        "The proxy failed to handle the request; this is a bug, not your input.",
        type="server_error",
        code="internal_error",
    )


def upstream_too_large(limit: int) -> ProxyError:
    """The backend's answer (or one event of its stream) passed the proxy's bound: what the
    request asked for (echo with logprobs, prompt_logprobs ...) is too large to relay."""
    return ProxyError(
        502,
        f"The answer to this request passed the proxy's limit of {limit} bytes (for one"
        " event of a stream, or a whole answer); ask for less (echo, logprobs,"
        " prompt_logprobs, n) or ask the operator to raise the relay's bounds.",
        type="server_error",
        code="upstream_too_large",
    )


def poison_pill(resets: int) -> ProxyError:
    """Backends broke (reset, invalid answer) while they may have been running the request:
    retrying it again could break another."""
    return ProxyError(
        502,
        f"The request broke the connection to {resets} backends; it is not retried again.",
        type="server_error",
        code="upstream_reset",
    )


def engine_killed() -> ProxyError:
    """A backend's engine died while this request was the only one it ran: the request is the
    likely cause (vLLM has had inputs that crash its engine core), so it is not retried where
    it could take down another engine."""
    return ProxyError(
        502,
        "The backend's engine died while running this request alone; it is not retried, so that"
        " it cannot take down another engine.",
        type="server_error",
        code="engine_dead",
    )


def backends_failed(kind: str) -> ProxyError:
    """Every attempt met a backend that answered and broke (reset, engine died)."""
    return ProxyError(
        502,
        f"No backend could complete the request ({kind}); retry later.",
        type="server_error",
        code="backends_failed",
    )


def memory_full() -> ProxyError:
    """The proxy holds as much request data as its memory budget allows (limits.max_held_bytes)."""
    return ProxyError(
        503,
        "The service holds as many requests as its memory allows; retry shortly.",
        type="server_error",
        code="proxy_memory_full",
        retry_after_s=1,
    )


def shared_state_unavailable(retry_after_s: float) -> ProxyError:
    """``shared_state.on_failure: refuse`` while Redis cannot be reached."""
    return ProxyError(
        503,
        "The proxy's shared state is unreachable; retry after the indicated time.",
        type="server_error",
        code="shared_state_unavailable",
        retry_after_s=retry_after_s,
    )


def refused_early(tier: str, predicted_wait_s: float, timeout_s: float) -> ProxyError:
    """429 at once: the request would wait longer than its tier's queue timeout (issue #16)."""
    return ProxyError(
        429,
        f"The {tier} tier's queue would hold this request about {predicted_wait_s:.1f}s,"
        f" longer than its {timeout_s:g}s limit; retry after the indicated time.",
        type="rate_limit_error",
        code="predicted_wait_too_long",
        retry_after_s=predicted_wait_s,
    )
