"""ASGI middleware for vLLM's API server: trust the proxy's signed ticket and nothing else.

Loaded with ``--middleware proxy.vllm_plugin.middleware.TicketMiddleware``. Deny by default
(``routes.rule_for``): every request but GET/HEAD/OPTIONS (and SageMaker's POST /ping) is
ticketed, whatever its path. For those it checks, in order: one ``X-Tierproxy-Ticket`` (ASCII,
v2, HMAC), its validity window and deadline, ``X-Request-Id`` = the ticket's request id, then
(after reading the body) the body's SHA-256 = the ticket's, its ``cache_salt`` = the ticket's
(when the ticket binds one), and last the nonce's first use. It
then rewrites the JSON body:

- ``priority`` comes from the ticket, or is the unticketed priority (the lowest tier);
- tierproxy keys a caller put in ``vllm_xargs`` (or ``sampling_params.extra_args``) are dropped;
- on the proxy's generation routes ``vllm_xargs`` carries tier, priority, time limit (a
  duration, ``Ticket.time_limit_s``), prefill share and budget to the scheduler, and the
  ``max_*tokens`` fields are clamped to the budget.

``X-Vllm-Priority`` is removed from every request, since vLLM lets it override the body. With
``TIERPROXY_REQUIRE_TICKET=1`` a request without a valid ticket is refused: 401 when there is
none, 403 when it does not verify, both OpenAI-shaped JSON; a WebSocket is closed (1008).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.ticket import (
    REQUEST_ID_HEADER,
    TICKET_HEADER,
    XARG_BUDGET,
    XARG_PREFILL_SHARE,
    XARG_PREFIX,
    XARG_PRIORITY,
    XARG_TIER,
    XARG_TIME_LIMIT,
    XARG_TRUSTED,
    Ticket,
)
from proxy.vllm_plugin.clock import ClockWatch
from proxy.vllm_plugin.routes import GENERATION_PATHS, Rule, rule_for
from proxy.vllm_plugin.settings import MiddlewareSettings
from proxy.vllm_plugin.verify import (
    EXPIRED,
    ISSUED_IN_FUTURE,
    ReplayCache,
    ReplayCacheFull,
    body_matches,
    check_binding,
    check_ticket,
    salt_matches,
)

__all__ = ["GENERATION_PATHS", "TicketMiddleware", "check_ticket", "rewrite_body"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm.tierproxy.middleware")

BUDGET_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens", "max_output_tokens")

_TICKET_HEADER_RAW = TICKET_HEADER.lower().encode("latin-1")
_REQUEST_ID_HEADER_RAW = REQUEST_ID_HEADER.lower().encode("latin-1")
_PRIORITY_HEADER_RAW = b"x-vllm-priority"
_MISSING = "missing ticket"


def _default_budget_field(path: str) -> str:
    return "max_output_tokens" if path == "/v1/responses" else "max_tokens"


def _without_our_keys(extra: Any) -> Any:
    if not isinstance(extra, dict):
        return extra  # malformed: vLLM answers it with its own 400
    return {k: v for k, v in extra.items() if not str(k).startswith(XARG_PREFIX)}


def rewrite_body(
    body: dict[str, Any], ticket: Ticket | None, *, path: str, unticketed_priority: int
) -> dict[str, Any]:
    """The body vLLM will see. Pure: the input is not modified."""
    out = dict(body)
    out["priority"] = ticket.priority if ticket is not None else unticketed_priority
    params = out.get("sampling_params")
    if isinstance(params, dict) and "extra_args" in params:  # /inference/v1/generate
        out["sampling_params"] = {**params, "extra_args": _without_our_keys(params["extra_args"])}

    caller_xargs = out.get("vllm_xargs")
    xargs = _without_our_keys(caller_xargs) if caller_xargs is not None else {}
    if ticket is not None and path in GENERATION_PATHS and isinstance(xargs, dict):
        xargs.update(
            {
                XARG_TIER: ticket.tier,
                XARG_PRIORITY: ticket.priority,
                XARG_TIME_LIMIT: ticket.time_limit_s,  # a duration: no clock skew in it
                XARG_PREFILL_SHARE: ticket.prefill_share,
                XARG_BUDGET: ticket.budget,
                XARG_TRUSTED: 1,  # vllm_xargs values are str/int/float: no bool
            }
        )
    if ticket is not None and path in GENERATION_PATHS:
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


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (not JSON, or not an object)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _error_body(status: int, message: str) -> bytes:
    err_type = {401: "AuthenticationError", 403: "PermissionDeniedError"}.get(
        status, "ServiceUnavailableError"
    )
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return json.dumps(payload).encode("utf-8")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class TicketMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): buffers only the bodies it rewrites, and hands every
    later ``receive()`` to the server's own, so vLLM still sees ``http.disconnect``."""

    def __init__(
        self,
        app: ASGIApp,
        settings: MiddlewareSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        # from_env refuses to start with a missing, short or placeholder secret.
        self.settings = settings if settings is not None else MiddlewareSettings.from_env()
        self.clock = clock  # epoch seconds, as the proxy's issued_at
        self.replay = ReplayCache(self.settings.replay_cache_size)
        self.clock_watch = ClockWatch(
            window_s=self.settings.ticket_window_s, max_skew_s=self.settings.ticket_max_skew_s
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        tickets = [v for k, v in headers if k.lower() == _TICKET_HEADER_RAW]
        request_ids = [v for k, v in headers if k.lower() == _REQUEST_ID_HEADER_RAW]
        # Both our header and vLLM's priority header stop here, whatever the endpoint.
        headers = [
            (k, v)
            for k, v in headers
            if k.lower() not in (_TICKET_HEADER_RAW, _PRIORITY_HEADER_RAW)
        ]
        scope = dict(scope)
        scope["headers"] = headers
        if kind == "websocket":
            # Realtime sessions run the model but carry no body to bind: never with tickets on.
            if self.settings.require_ticket:
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        rule = rule_for(str(scope.get("method", "")), path)
        if rule is Rule.PASS:
            await self.app(scope, receive, send)
            return

        try:
            ticket = self._verified_headers(tickets, request_ids)
            body = await self._read_body(receive)
            if body is None:
                return  # the caller left before sending its body: nothing to run
            parsed = _json_object(body)
            ticket = self._verified_body(ticket, body, parsed)
        except _Refused as refused:
            await self._refuse(send, refused.status, refused.message)
            return

        new_body = self._rewritten(body, parsed, ticket, path)
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

    def _untrusted(self, problem: str) -> None:
        """Without a trusted ticket: refuse if tickets are required, else run unticketed."""
        logger.debug("tierproxy: unticketed request: %s", problem)
        if self.settings.require_ticket:
            status = 401 if problem == _MISSING else 403
            raise _Refused(status, f"tierproxy ticket required: {problem}")

    def _verified_headers(self, tickets: list[bytes], request_ids: list[bytes]) -> Ticket | None:
        ticket, problem = check_ticket(tickets, self.settings.secret)
        if ticket is not None:
            now = self.clock()
            problem = check_binding(
                ticket,
                request_ids,
                now=now,
                window_s=self.settings.ticket_window_s,
                max_skew_s=self.settings.ticket_max_skew_s,
            )
            if problem in (ISSUED_IN_FUTURE, EXPIRED):  # genuine, but the clocks disagree
                reason = "future" if problem == ISSUED_IN_FUTURE else "expired"
                self.clock_watch.refused(reason, ticket.issued_at, now)
        if problem is not None:
            self._untrusted(problem)
            return None
        return ticket

    def _verified_body(
        self, ticket: Ticket | None, body: bytes, parsed: dict[str, Any] | None
    ) -> Ticket | None:
        if ticket is None:
            return None
        if not body_matches(ticket, body):
            self._untrusted("ticket is for another body")
            return None
        if not salt_matches(ticket, parsed):
            self._untrusted("ticket is for another cache salt")
            return None
        # Last, so a request that fails any other check cannot use up a genuine nonce.
        now = self.clock()
        forget_at = max(ticket.issued_at, now) + self.settings.ticket_window_s
        try:
            fresh = self.replay.first_use(ticket.nonce, forget_at, now)
        except ReplayCacheFull as exc:
            logger.warning("tierproxy: %s; refusing", exc)
            raise _Refused(503, "tierproxy ticket replay cache full; retry shortly") from None
        if not fresh:
            self._untrusted("ticket already used")
            return None
        return ticket

    @staticmethod
    async def _read_body(receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _rewritten(
        self, body: bytes, parsed: dict[str, Any] | None, ticket: Ticket | None, path: str
    ) -> bytes:
        if parsed is None:
            return body  # vLLM rejects it with its own 400; nothing in it can be trusted anyway
        new = rewrite_body(
            parsed, ticket, path=path, unticketed_priority=self.settings.unticketed_priority
        )
        return json.dumps(new, separators=(",", ":")).encode("utf-8")

    @staticmethod
    async def _refuse(send: Send, status: int, message: str) -> None:
        payload = _error_body(status, message)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode("ascii")),
        ]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})
