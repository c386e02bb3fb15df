"""ASGI middleware for vLLM's API server: trust the proxy's signed ticket and nothing else.

Loaded with ``--middleware proxy.vllm_plugin.middleware.TicketMiddleware``. For POST requests to
the generation endpoints it verifies the ``X-Tierproxy-Ticket`` HMAC, then rewrites the JSON body:

- ``priority`` comes from the ticket, or is the unticketed priority (the lowest tier);
- ``vllm_xargs`` carries tier, priority, deadline, prefill share and budget to the scheduler
  (``request.sampling_params.extra_args``); tierproxy keys a caller put there are dropped;
- ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` are clamped to the budget.

``X-Vllm-Priority`` is removed from every request, since vLLM lets it override the body. With
``TIERPROXY_REQUIRE_TICKET=1`` a request without a valid ticket is refused (401 / 403).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.ticket import (
    TICKET_HEADER,
    XARG_BUDGET,
    XARG_DEADLINE,
    XARG_PREFILL_SHARE,
    XARG_PREFIX,
    XARG_PRIORITY,
    XARG_TIER,
    XARG_TRUSTED,
    Ticket,
    TicketError,
    decode_ticket,
)
from proxy.vllm_plugin.settings import MiddlewareSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm.tierproxy.middleware")

# Endpoints whose requests generate tokens: full ticket handling (priority, xargs, budget).
GENERATION_PATHS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
)
# Pooling endpoints also reach the scheduler with a body `priority`; only that is enforced.
PRIORITY_ONLY_PATHS: frozenset[str] = frozenset(
    {
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
BUDGET_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens", "max_output_tokens")

_TICKET_HEADER_RAW = TICKET_HEADER.lower().encode("latin-1")
_PRIORITY_HEADER_RAW = b"x-vllm-priority"


class TicketRefused(Exception):
    """No valid ticket while tickets are required; carries the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_ticket(values: list[str], secret: bytes) -> tuple[Ticket | None, str | None]:
    """(ticket, None) for one valid ticket header, else (None, why it is not trusted)."""
    if not values:
        return None, "missing ticket"
    if len(values) > 1:
        return None, "more than one ticket header"
    try:
        return decode_ticket(values[0], secret), None
    except TicketError as exc:
        return None, str(exc)


def _default_budget_field(path: str) -> str:
    return "max_output_tokens" if path == "/v1/responses" else "max_tokens"


def rewrite_body(
    body: dict[str, Any], ticket: Ticket | None, *, path: str, unticketed_priority: int
) -> dict[str, Any]:
    """The body vLLM will see. Pure: the input is not modified."""
    out = dict(body)
    priority = ticket.priority if ticket is not None else unticketed_priority
    if path not in GENERATION_PATHS:
        if "priority" in out:
            out["priority"] = priority
        return out
    out["priority"] = priority

    caller_xargs = out.get("vllm_xargs")
    xargs: dict[str, Any] = {}
    if isinstance(caller_xargs, dict):
        xargs = {k: v for k, v in caller_xargs.items() if not str(k).startswith(XARG_PREFIX)}
    if ticket is not None:
        xargs.update(
            {
                XARG_TIER: ticket.tier,
                XARG_PRIORITY: ticket.priority,
                XARG_DEADLINE: ticket.deadline,
                XARG_PREFILL_SHARE: ticket.prefill_share,
                XARG_BUDGET: ticket.budget,
                XARG_TRUSTED: 1,  # vllm_xargs values are str/int/float: no bool
            }
        )
        _clamp_budget(out, ticket.budget, _default_budget_field(path))
    if xargs:
        out["vllm_xargs"] = xargs
    elif isinstance(caller_xargs, dict):
        out.pop("vllm_xargs")  # held only our keys
    # A malformed (non-object) vllm_xargs stays: vLLM answers it with its own 400.
    return out


def _clamp_budget(body: dict[str, Any], budget: int, default_field: str) -> None:
    present = False
    for name in BUDGET_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            present = True
            if value > budget:
                body[name] = budget
        elif value is not None:
            present = True  # malformed: left for vLLM's own validation to reject
    if not present:
        body[default_field] = budget


def _error_body(status: int, message: str) -> bytes:
    err_type = "AuthenticationError" if status == 401 else "PermissionDeniedError"
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return json.dumps(payload).encode("utf-8")


class TicketMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): buffers only the bodies it rewrites, and hands every
    later ``receive()`` to the server's own, so vLLM still sees ``http.disconnect``."""

    def __init__(self, app: ASGIApp, settings: MiddlewareSettings | None = None) -> None:
        self.app = app
        self.settings = settings if settings is not None else MiddlewareSettings.from_env()
        if not self.settings.secret:
            logger.warning(
                "tierproxy: TIERPROXY_TICKET_SECRET is not set; every request runs as unticketed"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        tickets = [v.decode("latin-1") for k, v in headers if k.lower() == _TICKET_HEADER_RAW]
        # Both our header and vLLM's priority header stop here, whatever the endpoint.
        headers = [
            (k, v)
            for k, v in headers
            if k.lower() not in (_TICKET_HEADER_RAW, _PRIORITY_HEADER_RAW)
        ]
        scope = dict(scope)
        scope["headers"] = headers
        if scope.get("method") != "POST" or (
            path not in GENERATION_PATHS and path not in PRIORITY_ONLY_PATHS
        ):
            await self.app(scope, receive, send)
            return

        ticket, problem = check_ticket(tickets, self.settings.secret)
        if ticket is None:
            logger.debug("tierproxy: unticketed %s: %s", path, problem)
            if self.settings.require_ticket:
                status = 401 if problem == "missing ticket" else 403
                await self._refuse(send, status, f"tierproxy ticket required: {problem}")
                return

        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the caller left before sending its body: nothing to run
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        new_body = self._rewritten(body, ticket, path)
        scope["headers"] = [(k, v) for k, v in headers if k.lower() != b"content-length"] + [
            (b"content-length", str(len(new_body)).encode("ascii"))
        ]

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": new_body, "more_body": False}
            # From here on the server's own receive: disconnect detection keeps working.
            return await receive()

        await self.app(scope, replay, send)

    def _rewritten(self, body: bytes, ticket: Ticket | None, path: str) -> bytes:
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return body  # vLLM rejects it with its own 400; nothing in it can be trusted anyway
        if not isinstance(parsed, dict):
            return body
        new = rewrite_body(
            parsed, ticket, path=path, unticketed_priority=self.settings.unticketed_priority
        )
        return json.dumps(new, separators=(",", ":")).encode("utf-8")

    @staticmethod
    async def _refuse(send: Send, status: int, message: str) -> None:
        payload = _error_body(status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode("ascii")),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})
