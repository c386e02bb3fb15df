"""What one upstream call is (``UpstreamCall``), what its relay reports (``RelayResult``), and
the failure that may be retried elsewhere (``UpstreamUnavailable``): the types the relay
(``proxy.relay.forward``, ``proxy.relay.responses``) and the request path share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api.errors import ProxyError, execution_timeout
from proxy.api.outcome import Outcome
from proxy.config.server import Relay
from proxy.relay.budget import MemoryBudget
from proxy.relay.delivered import Delivered

__all__ = ["UPSTREAM_STARTED", "NoAnswerHead", "RelayResult", "UpstreamCall", "UpstreamUnavailable"]


class UpstreamUnavailable(Exception):
    """The backend failed before anything reached the client: safe to retry elsewhere, once
    only where the backend may have run the request (``maybe_ran``: a reset or an invalid
    answer after it was sent, or its engine died: the request may be what killed it)."""

    def __init__(
        self, kind: str, detail: str, status: int | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status
        self.body = body

    @property
    def maybe_ran(self) -> bool:
        return self.kind in ("reset", "engine_dead")


@dataclass
class RelayResult:
    """What the caller needs for accounting and metrics."""

    response: web.StreamResponse
    outcome: Outcome  # ok | backend_error | client_error | upstream_error | timeout | client_gone
    status: int  # | client_stalled
    usage: dict[str, Any] | None = None
    first_token_at: float | None = None
    backend_failed: bool = False  # counts toward passive ejection
    # Past the relay's size bounds (the request chose its size): billed the usage found in the
    # rest of the answer, else its reservation (proxy.request.admitted.Admitted.billed_usage).
    oversize: bool = False
    # A 200 answer vLLM generated whole before its first byte (not a stream), cut before its
    # usage went by and without it in the rest of the body: billed its reservation.
    usage_lost: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    refused_in_stream: bool = False  # a stream whose first event was a 4xx error

    @property
    def engine_ran(self) -> bool:
        """False where the backend refused the request (a 4xx, also as a stream's first
        event): its engine did no work."""
        return self.outcome is not Outcome.CLIENT_ERROR and not self.refused_in_stream


# RelayResult.extra: when the upstream call that answered began (the pipeline stamps it).
UPSTREAM_STARTED = "usage_started_at"


@dataclass(frozen=True)
class UpstreamCall:
    session: aiohttp.ClientSession
    url: str
    body: bytes
    headers: Mapping[str, str]
    deadline: float  # loop time
    timeout_s: float  # the tier's limit, for messages
    strip_usage_chunk: bool  # the proxy asked for usage; the client did not
    bounds: Relay = field(default_factory=Relay)
    budget: MemoryBudget | None = None  # what a buffered answer reserves while held
    # What a stream wrote to the client (the request's, kept when the handler is cancelled).
    delivered: Delivered = field(default_factory=Delivered)
    # The client's answer's X-Request-Id (its own echoed); None: the id sent upstream.
    reply_request_id: str | None = None
    # Called (with whether the engine ran it) once the backend is done with the answer (read to
    # its end, or closed), while its client may still be reading: the backend's room is handed
    # on then, not when the client has read it all (the caller's lease; it may come again).
    release_backend: Callable[[bool], None] = field(default=lambda ran: None)


class NoAnswerHead(ProxyError):
    """The tier's limit passed before the backend sent so much as its answer's head: the
    client's 504, as for any execution timeout. For a stream it is also the backend's failure:
    vLLM sends a stream's head as soon as it takes the request (however long the request then
    waits for the engine), so none at all means a server that no longer answers."""

    def __init__(self, limit_s: float) -> None:
        error = execution_timeout(limit_s)
        super().__init__(error.status, error.message, type=error.type, code=error.code)
