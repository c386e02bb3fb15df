"""Client connections: a cap on open connections, a header timeout and size, keep-alive (the
open-files limit: ``proxy.server.open_files``).

aiohttp has a keep-alive timeout (an idle connection closes) but no connection cap, no header
timeout and no bound on a request head's total size (only per line and per field count), so
listeners are made here with a small protocol factory around the runner's ``web.Server``: over
the cap the oldest connection still waiting for its first request head is evicted (a canned 503)
for the newcomer, and only when there is none the newcomer gets the 503, before anything is
parsed (``server.evict_at_cap``); a request whose
headers are not complete in time gets a canned 408, one whose head passes
``server.max_header_bytes`` a canned 431, one whose unfinished head would pass the budget of all
unfinished heads a canned 503; each then closes (answers in ``proxy.server.refusals``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.config.server import Server
from proxy.server.guarded_handler import GuardedHandler, handler_kwargs
from proxy.server.refusals import (
    OVER_CAPACITY,
    AddressShare,
    Admission,
    HeaderBudget,
    HeadWaiters,
    Refusal,
    RefusalLog,
)

log = logging.getLogger("tierproxy")


class ConnectionGate:
    """The protocol factory of a listener: aiohttp's handler, or a refusal over its cap."""

    def __init__(
        self,
        server: web.Server,
        settings: Server,
        open_connections: Callable[[], int],
        kwargs: dict[str, Any],
        on_refused: Callable[[], None] | None = None,
        *,
        cap: int | None = None,
        header_budget: HeaderBudget | None = None,
        refusal_log: RefusalLog | None = None,
        waiters: HeadWaiters | None = None,
        share: AddressShare | None = None,
    ) -> None:
        self.server = server
        self.settings = settings
        self.open_connections = open_connections  # on the listeners sharing this cap
        self.cap = cap if cap is not None else settings.max_connections
        # handler_cancellation belongs to web.Server, not to each connection's handler.
        self.kwargs = {k: v for k, v in kwargs.items() if k != "handler_cancellation"}
        self.refused = 0
        self.on_refused = on_refused  # e.g. a Prometheus counter's inc
        self.header_budget = header_budget or HeaderBudget(settings.max_pending_header_bytes)
        self.refusal_log = refusal_log or RefusalLog(f"connection cap {self.cap} reached")
        self.lingering = [0]  # refused connections not closed yet (shared with each Refusal)
        self.waiters = waiters or HeadWaiters()  # shared by the listeners sharing this cap
        self.share = share or AddressShare(None)
        self.evicted = 0
        self.eviction_log = RefusalLog(
            f"connection cap {self.cap} reached, oldest waiting for a request head", verb="evicted"
        )

    def __call__(self) -> asyncio.BaseProtocol:
        # Evicted connections count as open until their connection_lost: not evicted twice over.
        if self.open_connections() - self.waiters.evicting >= self.cap:
            if self.settings.evict_at_cap and len(self.waiters):
                # Room is made once the newcomer's address is known (and within its share).
                return self._handler(Admission(self.share, self._make_room))
            self._count_refusal()
            return Refusal(OVER_CAPACITY, self.lingering)
        return self._handler(Admission(self.share) if self.share.limit else None)

    def _count_refusal(self) -> None:
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused()
        self.refusal_log.refused()

    def _make_room(self) -> bool:
        if not self.waiters.evict_oldest():
            self._count_refusal()
            return False
        self.evicted += 1
        self.eviction_log.refused()
        return True

    def _handler(self, admission: Admission | None) -> GuardedHandler:
        return GuardedHandler(
            self.server,
            loop=asyncio.get_running_loop(),
            header_timeout_s=self.settings.header_timeout_s,
            max_header_bytes=self.settings.max_header_bytes,
            header_budget=self.header_budget,
            waiters=self.waiters,
            admission=admission,
            **self.kwargs,
        )


class Listeners:
    """Apps served on their own listeners; leaving the ``async with`` closes the listeners, then
    cleans the apps up in reverse order (the first app, whose lifecycle owns the shared state,
    last). Listeners share ``server.max_connections``, but for one added with ``reserved``
    connections of its own (the admin listener: /metrics and drain answer during a flood)."""

    def __init__(self, settings: Server, on_refused: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.on_refused = on_refused
        self.runners: list[web.AppRunner] = []
        self.shared: list[web.AppRunner] = []  # the runners under server.max_connections
        self.servers: list[asyncio.Server] = []
        self.gates: list[ConnectionGate] = []
        self.header_budget = HeaderBudget(settings.max_pending_header_bytes)
        self.refusal_log = RefusalLog(f"connection cap {settings.max_connections} reached")
        self.waiters = HeadWaiters()  # of the listeners under the shared cap
        self.share = AddressShare(settings.max_connections_per_address)
        # `serve --workers N`: N processes bind the same port; the kernel spreads connections.
        self.reuse_port = False

    def open_connections(self) -> int:
        """On every listener, reserved ones included."""
        return _count(self.runners)

    async def add(
        self, app: web.Application, host: str, port: int, *, reserved: int | None = None
    ) -> int:
        """Serve ``app`` on host:port; returns the bound port (for port 0). With ``reserved``,
        the listener has that many connections of its own, apart from the shared cap."""
        kwargs = handler_kwargs(self.settings)
        runner = web.AppRunner(app, **kwargs)
        await runner.setup()
        self.runners.append(runner)
        assert runner.server is not None
        if reserved is None:
            self.shared.append(runner)
            gate = ConnectionGate(
                runner.server,
                self.settings,
                lambda: _count(self.shared),
                kwargs,
                self.on_refused,
                header_budget=self.header_budget,
                refusal_log=self.refusal_log,
                waiters=self.waiters,
                share=self.share,
            )
        else:
            gate = ConnectionGate(
                runner.server,
                self.settings,
                lambda: _count([runner]),
                kwargs,
                self.on_refused,
                cap=reserved,
                header_budget=self.header_budget,
                refusal_log=RefusalLog(f"{host}:{port}: its {reserved} reserved connections"),
            )
        self.gates.append(gate)
        loop = asyncio.get_running_loop()
        # A burst of new connections waits in the kernel, not in connect errors.
        server = await loop.create_server(
            gate, host, port, backlog=2048, reuse_address=True, reuse_port=self.reuse_port or None
        )
        self.servers.append(server)
        bound: int = server.sockets[0].getsockname()[1]
        log.info("listening on %s:%d", host, bound)
        return bound

    async def __aenter__(self) -> Listeners:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            server.close()
        for runner in reversed(self.runners):
            await runner.cleanup()


def _count(runners: list[web.AppRunner]) -> int:
    return sum(len(runner.server.connections) for runner in runners if runner.server)
