"""The path of a generation request, one named step per method, in request order:
authenticate → parse → quotas → tenant limits → queue → dispatch → forward → account → log

``RequestPipeline.handle`` reads top to bottom as that list (the flat ``HandleRequest`` of the
Gateway API Inference Extension). Every collaborator is injected (clock, limit-wait sleep, relay,
limits, queue, dispatcher, pool, metrics): the whole path runs in unit tests with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from proxy.api.errors import (
    ProxyError,
    config_changed,
    memory_full,
    model_not_found,
    queue_full,
    queue_timeout,
    refused_early,
)
from proxy.api.hotpath import LabelCache
from proxy.api.outcome import Outcome
from proxy.api.reply_headers import ADMITTED_LIMITS, REQUEST_ID, ratelimit_headers
from proxy.api.routes import BY_ENDPOINT, Endpoint, Route
from proxy.backends.pool import BackendPool
from proxy.config.schema import Config, LoadedConfig
from proxy.config.tenants import Tenant
from proxy.relay.budget import MemoryBudget, Reservation
from proxy.relay.forward import RelayResult, UpstreamUnavailable
from proxy.relay.result import UPSTREAM_STARTED, NoAnswerHead
from proxy.request.accounting import account, charge_usage
from proxy.request.adapter_gate import AdapterGate
from proxy.request.admitted import Admitted, FinishHook, Trace, no_finish_hook
from proxy.request.answers import Answers
from proxy.request.auth import identify
from proxy.request.backend_faults import no_answer_head, retry_elsewhere
from proxy.request.inbound import parse_body, read_body
from proxy.request.leases import direct_lease
from proxy.request.pending import PendingAdmissions
from proxy.request.prompt_blocks import PromptBlocks
from proxy.request.quota_gate import QuotaGate
from proxy.request.route_table import ROWS, Relay
from proxy.request.tenancy import tenant_gate
from proxy.request.tenant_limits import pass_tenant_limits, settle_tenant_limits
from proxy.request.traced import upstream_spans
from proxy.request.uploads import TenantUploads, UploadRefused, closing
from proxy.request.upstream import upstream_call
from proxy.scheduling.dispatch import CheapLease, Dispatcher, Lease, QueueTimeoutError, Unservable
from proxy.scheduling.early_refusal import EarlyRefusal
from proxy.scheduling.limits import TenantLimits
from proxy.scheduling.queue import AdmissionQueue, QueueFull, UnknownTier
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.slo import backend_met, latency_of

if TYPE_CHECKING:  # loaded only where tracing is on (proxy.server.state)
    from proxy.telemetry.tracing import Tracing

log = logging.getLogger("tierproxy")

# Beyond the queue's own deadline (the dispatcher resolves the waiter by it): a backstop only.
_DISPATCH_GUARD_S = 5.0


class RequestPipeline:
    def __init__(
        self,
        *,
        config: Callable[[], LoadedConfig],
        secret: bytes,
        clock: Callable[[], float],
        limits: TenantLimits,
        queue: AdmissionQueue,
        dispatcher: Dispatcher,
        pool: BackendPool,
        metrics: ProxyMetrics,
        session: Callable[[], aiohttp.ClientSession],
        relay: Relay | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        budget: MemoryBudget | None = None,
        on_finish: FinishHook | None = None,
        quotas: QuotaGate | None = None,
        tracing: Tracing | None = None,
        prompt_blocks: PromptBlocks | None = None,
    ) -> None:
        self.config = config  # the current config; read once per request
        self.secret = secret
        self.clock = clock
        self.limits = limits
        self.queue = queue
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.session = session  # exists once the app has started
        self.relay = relay  # None: each route's own (proxy.request.route_table)
        self.sleep = sleep
        self.budget = budget if budget is not None else MemoryBudget(None)
        self.child = LabelCache()  # metric children of each request, looked up once
        self.on_finish = on_finish or no_finish_hook  # per-tenant usage (proxy.ops.usage)
        self.quotas = quotas or QuotaGate(metrics=metrics)  # day/month tokens and money
        self.pending = PendingAdmissions(dispatcher, self.quotas, pool)  # held to reloads
        self.uploads = TenantUploads()  # bodies coming in, per tenant
        self.prompt_blocks = prompt_blocks or PromptBlocks()  # the prompts' KV blocks
        self.adapters = AdapterGate()  # loads a request's LoRA adapter on its backend first
        self.tracing = tracing  # None: off, and no span object is made (docs/tracing.md)
        self.answers = Answers(
            config=config, clock=clock, limits=limits, metrics=metrics, child=self.child
        )

    def handler(self, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The aiohttp handler of one of ``proxy.api.routes.ROUTES``."""

        async def handle_route(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, route.endpoint)

        return handle_route

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        trace = Trace.begin(request.headers, self.clock())
        request[REQUEST_ID] = trace.reply_id  # for streams too (reply_headers)
        loaded = self.config()  # one config for the whole request, even if a reload happens
        adm: Admitted | None = None
        result: RelayResult | None = None
        try:
            trace.tenant, trace.key_hash = identify(request.headers, loaded)
            if self.tracing is not None:  # after the key: no keyless client's trace recorded
                trace.spans = self.tracing.begin(
                    request, trace.request_id, trace.arrival, self.clock(), trace.tenant.name
                )
            adm = await self.parse(request, endpoint, loaded.config, trace.tenant, trace)
            trace.admitted, adm.spans, adm.key_hash = True, trace.spans, trace.key_hash
            await self.pending.admit(adm)  # its quotas reserved (or refused): settled below
            await self.pass_tenant_limits(adm)
            request[ADMITTED_LIMITS] = ratelimit_headers(adm.limit_windows)  # streams' too
            try:
                while result is None:  # None: a backend failed before its first byte, again
                    lease: Lease | CheapLease
                    if BY_ENDPOINT[endpoint].cheap:
                        lease = direct_lease(self.pool, adm, self.clock)
                    else:  # queued with its prompt's blocks (for kv_aware; None: off)
                        adm = await self.prompt_blocks.given(adm, self)
                        lease = await self.dispatch(adm, self.enqueue(adm))
                        await self.adapters.ready(lease, adm.parsed.model)
                    result = await self.forward(request, adm, lease)
                    if self.adapters.forgotten(lease, adm, result):
                        result = None  # the engine lost its adapter: loaded on the next pass
                self.account(adm, result)
                trace.latency = latency_of(adm.arrival, result, self.clock())
            finally:
                self.settle_tenant_limits(adm, result)
            return await self.answers.deliver(request, trace, result, adm.config.relay)
        except ProxyError as err:
            refused = self.answers.refuse(trace, err)
            return await closing(request, refused) if isinstance(err, UploadRefused) else refused
        except asyncio.CancelledError:
            trace.outcome, trace.status = Outcome.CLIENT_GONE, 499
            raise
        finally:
            if adm is not None:
                if result is None:  # its client left, or the tier's limit cut it: still billed
                    self.charge_usage(adm, None)
                self.pending.ended(adm, result)  # its quotas settled to what it used
                if adm.held is not None:
                    adm.held.release()
            self.on_finish(trace, adm, result)
            self.answers.log(trace)

    # -- parse ---------------------------------------------------------------------------

    async def parse(
        self,
        request: web.Request,
        endpoint: Endpoint,
        config: Config,
        tenant: Tenant,
        trace: Trace,
    ) -> Admitted:
        # Held until the request ends, reserved before its body is read (proxy.request.body);
        # over the budget, refused now rather than grow the heap.
        held = self.budget.try_reserve(0)
        if held is None:
            raise memory_full()
        try:
            return await self._parse(request, endpoint, config, tenant, trace, held)
        except BaseException:
            held.release()
            raise

    async def _parse(
        self,
        request: web.Request,
        endpoint: Endpoint,
        config: Config,
        tenant: Tenant,
        trace: Trace,
        held: Reservation,
    ) -> Admitted:
        # Everything a client can get wrong is refused here, before any queue or backend lease.
        with self.uploads.body_of(tenant.name, config):
            raw = await read_body(request, config.limits.max_body_bytes, config.input, held)
        parsed = parse_body(
            raw,
            endpoint,
            config.tiers[tenant.tier],
            config.limits,
            config.scheduling,
            path=request.path,
            token_limit=tenant.tokens_per_minute,
            inputs=config.input,
        )
        salt = tenant_gate(self.pool, self.secret, config, tenant, parsed)
        # The estimate reserved while the body was read (6x its bytes) grows to what the parsed
        # body measures where that is more: tiny containers hold up to 24x their bytes.
        if not held.grow(parsed.held_bytes - held.amount):
            raise memory_full()
        return Admitted(
            config, tenant, parsed, trace.request_id, trace.arrival, held=held, cache_salt=salt
        )

    # -- tenant limits -------------------------------------------------------------------

    async def pass_tenant_limits(self, adm: Admitted) -> None:
        await pass_tenant_limits(
            adm, self.limits, self.metrics, self.queue, self.clock, self.sleep, self.retry_after
        )

    def settle_tenant_limits(self, adm: Admitted, result: RelayResult | None) -> None:
        settle_tenant_limits(adm, result, self.limits, self.clock())

    # -- queue and dispatch --------------------------------------------------------------

    def enqueue(self, adm: Admitted) -> asyncio.Future[Lease]:
        """Into the tier's queue; a retry goes back at its old place, past the cap."""
        self.pending.entering(adm, self.config())  # a reload may have refused it since
        try:
            if adm.spans is not None:  # the tier's depth before it: its place at entry
                depth = self.queue.depth(adm.tier)
                adm.spans.queue_wait(adm.tier, depth, adm.attempts, self.clock())
            return self.dispatcher.enqueue(adm.queued, force=adm.attempts > 0)
        except QueueFull:
            raise queue_full(adm.tier, self.retry_after(adm.tier)) from None
        except EarlyRefusal as exc:
            timeout = adm.config.tiers[adm.tier].queue_timeout_s
            raise refused_early(adm.tier, exc.predicted_wait_s, timeout) from None
        except UnknownTier:  # a reload removed the tier since this request's admission
            raise config_changed() from None

    async def dispatch(self, adm: Admitted, waiter: asyncio.Future[Lease]) -> Lease:
        """Wait for the dispatcher to hand the request a slot on a backend."""
        queued = adm.queued
        # The tier is there: the request was queued without an await since.
        waited_at_most = self.queue.limits(queued.tier).queue_timeout_s
        try:
            async with asyncio.timeout(waited_at_most + _DISPATCH_GUARD_S):
                return await waiter
        except QueueFull:  # displaced by a tenant with a smaller share of the full tier
            raise queue_full(adm.tier, self.retry_after(adm.tier), displaced=True) from None
        except QueueTimeoutError as exc:
            raise queue_timeout(adm.tier, exc.waited_s, self.retry_after(adm.tier)) from None
        except Unservable:  # a reload left no backend for its adapter: as for a new request
            raise model_not_found(queued.model) from None
        except TimeoutError:
            self.dispatcher.withdraw(queued)
            raise queue_timeout(adm.tier, waited_at_most, self.retry_after(adm.tier)) from None
        except asyncio.CancelledError:
            self.dispatcher.withdraw(queued)
            raise

    def retry_after(self, tier: str) -> float:
        return self.queue.retry_after(tier, self.pool.slots())

    # -- forward -------------------------------------------------------------------------

    async def forward(
        self, request: web.Request, adm: Admitted, lease: Lease | CheapLease
    ) -> RelayResult | None:
        """Relay the request to the leased backend; None: it failed before anything reached
        the client (retry); 503/502 once attempts run out, or a second backend that ran it broke.
        The relay releases the lease once the backend is done, its client maybe still reading."""
        adm.attempts += 1
        ran: bool | None = True  # unless known otherwise; None: the client left (the chooser tells)
        try:
            result = await self.relay_once(request, adm, lease)
            ran = result.engine_ran
            return result
        except asyncio.CancelledError:
            ran = None
            raise
        except UpstreamUnavailable as exc:
            ran = exc.maybe_ran
            retry_elsewhere(exc, adm, lease, self.pool, self.metrics, self.clock())
            return None
        except NoAnswerHead:
            no_answer_head(adm, lease, self.pool, self.metrics, self.clock())
            raise
        finally:
            lease.release(ran=ran)  # what did not run leaves no trace in the chooser

    async def relay_once(
        self, request: web.Request, adm: Admitted, lease: Lease | CheapLease
    ) -> RelayResult:
        traced = None if adm.spans is None else upstream_spans(adm, lease, self.clock())
        call = upstream_call(
            adm.config,
            adm.parsed,
            tier_name=adm.tier,
            tenant=adm.tenant.name,
            request_id=adm.request_id,
            lease=lease,
            client_headers=request.headers,
            secret=self.secret,
            session=self.session(),
            budget=self.budget,
            delivered=adm.delivered,
            cache_salt=adm.cache_salt,
            reply_request_id=request.get(REQUEST_ID),
            trace_headers=traced,
        )
        relay_fn = self.relay or ROWS[adm.parsed.endpoint].relay
        started = self.clock()  # engine time starts here, whichever relay (usage log)
        result = await relay_fn(call, request, stream=adm.parsed.stream, now=self.clock)
        result.extra[UPSTREAM_STARTED] = started
        if adm.spans is not None:
            adm.spans.upstream_done(result, self.clock())
        if result.backend_failed:
            self.pool.record_failure(lease.backend, self.clock())
            self.metrics.backend_errors.labels(lease.backend.label, result.outcome).inc()
        else:
            self.pool.record_success(lease.backend, self.clock())
            if isinstance(lease, CheapLease):
                return result  # no generation: nothing for the room controller's latency
            # The backend's part of the latency, for its room controller (docs/slo.md): to its
            slo = adm.config.tiers[adm.tier].slo  # end, not a slow reader's (its lease's release)
            met = backend_met(slo, lease.granted_at, result, lease.backend_end(self.clock()))
            self.pool.observe_latency(lease.backend, self.clock(), met)
        return result

    # -- account -------------------------------------------------------------------------

    def account(self, adm: Admitted, result: RelayResult) -> None:
        account(adm, result, self.metrics, self.child, self.queue)

    def charge_usage(self, adm: Admitted, result: RelayResult | None) -> bool:
        return charge_usage(adm, result, self.metrics, self.child, self.queue)
