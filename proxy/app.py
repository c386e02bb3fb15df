"""Wiring: routes, startup and shutdown, the one place that knows every room."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.admission import QueuedRequest, QueueFull, TierLimits, UnknownTier
from proxy.backends import BackendState
from proxy.config import Config, ConfigError, LoadedConfig, Tenant, load_config
from proxy.dispatch import Lease, QueueTimeoutError
from proxy.errors import (
    ProxyError,
    bad_request,
    no_backend,
    queue_full,
    queue_timeout,
    rate_limited,
    unauthorized,
)
from proxy.forward import RelayResult, UpstreamCall, UpstreamUnavailable, relay
from proxy.inbound import (
    Endpoint,
    ParsedRequest,
    api_key_from,
    parse_body,
    too_large,
    upstream_headers,
)
from proxy.limits import LimitRegistry
from proxy.metrics import ProxyMetrics
from proxy.monitor import BackendMonitor
from proxy.policies.build import build_scheduling
from proxy.policies.cost import weighted_tokens
from proxy.reload import ConfigWatcher
from proxy.ticket import TICKET_HEADER, Ticket, encode_ticket, secret_from_env

log = logging.getLogger("tierproxy")
access_log = logging.getLogger("tierproxy.access")

_BODY_READ_TIMEOUT_S = 30.0
_UPSTREAM_PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}


def tier_limits(config: Config) -> dict[str, TierLimits]:
    return {
        name: TierLimits(t.weight, t.max_queue, t.queue_timeout_s)
        for name, t in config.tiers.items()
    }


class ProxyState:
    """Everything a request handler needs; swapped parts change on reload, in place."""

    def __init__(self, loaded: LoadedConfig, secret: bytes, clock: Callable[[], float]) -> None:
        self.loaded = loaded
        self.secret = secret
        self.clock = clock
        self.metrics = ProxyMetrics()
        cfg = loaded.config
        self.scheduling = build_scheduling(cfg, self.metrics, clock)
        self.queue = self.scheduling.queue
        self.pool = self.scheduling.pool
        self.dispatcher = self.scheduling.dispatcher
        self.limits = LimitRegistry()
        self.limits.configure(cfg.tenants, clock())
        self.session: aiohttp.ClientSession | None = None
        self.monitor: BackendMonitor | None = None
        self.watcher: ConfigWatcher | None = None
        self.metrics.config_generation.set(1)

    @property
    def config(self) -> Config:
        return self.loaded.config

    def apply(self, loaded: LoadedConfig) -> None:
        """Swap in a validated config; queued and running requests keep going."""
        cfg = loaded.config
        self.scheduling.reconfigure(cfg)
        self.limits.configure(cfg.tenants, self.clock())
        self.loaded = loaded
        self.metrics.config_generation.inc()
        self.dispatcher.kick()


STATE = web.AppKey("tierproxy_state", ProxyState)
_TENANT = web.RequestKey("tierproxy_tenant", Tenant)


@dataclass
class _Admitted:
    config: Config  # the config the request was admitted under, kept across reloads
    tenant: Tenant
    tier_name: str
    parsed: ParsedRequest
    request_id: str
    arrival: float


def create_app(
    loaded: LoadedConfig,
    *,
    secret: bytes | None = None,
    clock: Callable[[], float] = time.monotonic,
    watch_config: bool = False,
) -> web.Application:
    """The proxy app; with ``watch_config``, the file in ``loaded.source`` is reloaded on SIGHUP
    and whenever it changes."""
    secret = secret if secret is not None else secret_from_env(loaded.config.ticket_secret_env)
    if not secret:
        raise ConfigError(
            loaded.source,
            [
                f"ticket_secret_env: environment variable {loaded.config.ticket_secret_env} is not"
                " set (the HMAC key shared with the vLLM plugin)"
            ],
        )
    # The body limit is enforced by our own reader, which answers in the OpenAI shape.
    app = web.Application(client_max_size=2**62)
    state = ProxyState(loaded, secret, clock)
    app[STATE] = state
    if watch_config:
        state.watcher = ConfigWatcher(loaded.source, state.apply, state.metrics)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/backends", _admin_backends)
    app.router.add_post("/admin/backends/drain", _admin_drain)
    app.router.add_route("*", "/v1/{tail:.*}", _unsupported)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    health = state.config.backend_health
    state.session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=health.connect_timeout_s),
        # Idle upstream connections close before uvicorn's 5 s keep-alive would close them under
        # us (a request written into a connection the server is closing fails for nothing).
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
        read_bufsize=2**20,
        auto_decompress=False,
    )
    state.monitor = BackendMonitor(
        state.pool, state.session, state.metrics, state.dispatcher.kick, state.clock
    )
    state.dispatcher.start()
    state.monitor.start()
    if state.watcher is not None:
        state.watcher.start()
    try:
        yield
    finally:
        if state.watcher is not None:
            await state.watcher.stop()
        await state.monitor.stop()
        await state.dispatcher.stop()
        await state.session.close()


# -- generation endpoints ----------------------------------------------------------------


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = state.clock()
    request_id = uuid.uuid4().hex
    admitted: _Admitted | None = None
    outcome, status = "error", 500
    try:
        admitted = await _admit(request, state, endpoint, request_id, arrival)
        result = await _run(request, state, admitted)
        outcome, status = result.outcome, result.status
        result.response.headers.setdefault("X-Request-Id", request_id)
        return result.response
    except ProxyError as err:
        outcome, status = _outcome_of(err), err.status
        resp = err.response()
        resp.headers["X-Request-Id"] = request_id
        return resp
    except asyncio.CancelledError:
        outcome, status = "client_gone", 499
        raise
    finally:
        _log_access(state, request_id, admitted or request.get(_TENANT), outcome, status, arrival)


def _outcome_of(err: ProxyError) -> str:
    return {
        401: "unauthorized",
        413: "rejected",
        429: "queue_full" if err.code == "queue_full" else "rate_limited",
        503: "queue_timeout" if err.code == "queue_timeout" else "unavailable",
        504: "timeout",
    }.get(err.status, "rejected" if err.status < 500 else "error")


async def _admit(
    request: web.Request, state: ProxyState, endpoint: Endpoint, request_id: str, arrival: float
) -> _Admitted:
    loaded = state.loaded  # one config for the whole request, even if a reload happens
    key = api_key_from(request.headers)
    tenant = loaded.tenant_for_key(key) if key else None
    if tenant is None:
        raise unauthorized()
    request[_TENANT] = tenant  # for the access log, should the input be refused
    cfg = loaded.config
    tier = cfg.tiers[tenant.tier]
    raw = await _read_body(request, cfg.limits.max_body_bytes)
    parsed = parse_body(raw, endpoint, tier, cfg.limits, cfg.scheduling)
    if not state.pool.model_known(parsed.model):
        raise ProxyError(
            404,
            f"The model `{parsed.model}` does not exist.",
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )
    return _Admitted(cfg, tenant, tenant.tier, parsed, request_id, arrival)


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    body = bytearray()
    async with asyncio.timeout(_BODY_READ_TIMEOUT_S):
        async for chunk in request.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    return bytes(body)


async def _run(request: web.Request, state: ProxyState, adm: _Admitted) -> RelayResult:
    reserved = float(adm.parsed.prompt_tokens + adm.parsed.expected_output)
    await _pass_tenant_limits(state, adm, reserved)
    used: float | None = None
    try:
        result = await _queue_and_forward(request, state, adm)
        usage = result.usage or {}
        if isinstance(usage.get("total_tokens"), int):
            used = float(usage["total_tokens"])
        return result
    finally:
        state.limits.settle(adm.tenant.name, reserved, used, state.clock())


async def _pass_tenant_limits(state: ProxyState, adm: _Admitted, tokens: float) -> None:
    """Take the tenant's rate and concurrency allowance, or wait for it (``on_limit: queue``,
    within the tier's queue timeout), or refuse with 429 and the exact wait."""
    tenant = adm.tenant
    give_up_at = adm.arrival + adm.config.tiers[adm.tier_name].queue_timeout_s
    while True:
        verdict = state.limits.try_admit(tenant.name, tokens, state.clock())
        if verdict.allowed:
            return
        state.metrics.rate_limited.labels(tenant.name, verdict.limit).inc()
        wait = verdict.retry_after_s
        if tenant.on_limit != "queue" or state.clock() + wait > give_up_at:
            raise rate_limited(verdict.limit, wait)
        # Not a network wait: the bucket refills on the clock (or a slot frees).
        await asyncio.sleep(min(wait, 0.25) if verdict.limit == "max_concurrent" else wait)


async def _queue_and_forward(
    request: web.Request, state: ProxyState, adm: _Admitted
) -> RelayResult:
    cfg = adm.config
    tier = cfg.tiers[adm.tier_name]
    queued = QueuedRequest(
        tier=adm.tier_name,
        tenant=adm.tenant.name,
        prompt_tokens=adm.parsed.prompt_tokens,
        expected_output=adm.parsed.expected_output,
        arrival_s=adm.arrival,
        model=adm.parsed.model,
        tenant_weight=adm.tenant.weight,
    )
    attempts = 0
    last_unavailable: UpstreamUnavailable | None = None
    while True:
        lease = await _wait_for_turn(state, queued, force=attempts > 0)
        attempts += 1
        try:
            result = await _forward_once(
                request, state, adm, lease, tier.request_timeout_s, tier.priority
            )
        except UpstreamUnavailable as exc:
            last_unavailable = exc
            state.pool.record_failure(
                lease.backend, state.clock(), definitive=exc.kind == "connect"
            )
            state.metrics.backend_errors.labels(lease.backend.label, exc.kind).inc()
            log.warning(
                "request %s: backend %s unavailable (%s); attempt %d",
                adm.request_id,
                lease.backend.label,
                exc.kind,
                attempts,
            )
            if attempts >= cfg.backend_health.max_attempts:
                raise _give_up(last_unavailable) from None
            # Back into the queue at its old place: another backend takes it, or this one once
            # its short ejection ends (a single backend's hiccup is no reason to fail).
            state.metrics.retries.inc()
            continue
        finally:
            lease.release()
        _account(state, adm, queued, result, lease)
        return result


def _give_up(exc: UpstreamUnavailable) -> ProxyError:
    if exc.status == 503:
        return ProxyError(
            503,
            "Every backend tried is overloaded; retry later.",
            type="server_error",
            code="backend_overloaded",
            retry_after_s=1,
        )
    return no_backend(f"No backend could take the request ({exc.kind}); retry later.")


async def _wait_for_turn(state: ProxyState, queued: QueuedRequest, *, force: bool) -> Lease:
    try:
        limits = state.queue.limits(queued.tier)
        waiter = state.dispatcher.enqueue(queued, force=force)
    except QueueFull:
        raise queue_full(queued.tier, _retry_after(state, queued.tier)) from None
    except UnknownTier:
        # A reload removed the tier between this request's admission and its queueing.
        raise ProxyError(
            503,
            "The service's configuration changed; retry.",
            type="server_error",
            code="config_changed",
            retry_after_s=1,
        ) from None
    try:
        # The dispatcher resolves the waiter by the queue deadline; the guard is a backstop.
        async with asyncio.timeout(limits.queue_timeout_s + 5.0):
            return await waiter
    except QueueFull:  # displaced by a tenant with a smaller share of the full tier
        raise queue_full(queued.tier, _retry_after(state, queued.tier), displaced=True) from None
    except QueueTimeoutError as exc:
        raise queue_timeout(queued.tier, exc.waited_s, _retry_after(state, queued.tier)) from None
    except TimeoutError:
        state.dispatcher.withdraw(queued)
        raise queue_timeout(
            queued.tier, limits.queue_timeout_s, _retry_after(state, queued.tier)
        ) from None
    except asyncio.CancelledError:
        state.dispatcher.withdraw(queued)
        raise


def _retry_after(state: ProxyState, tier: str) -> float:
    """A rough wait before retrying: the tier's backlog over the slots that serve it."""
    slots = sum(b.cfg.max_inflight for b in state.pool.all()) or 1
    try:
        ceiling = state.queue.limits(tier).queue_timeout_s
    except UnknownTier:
        return 1.0
    return max(1.0, min(ceiling, state.queue.depth(tier) / slots))


async def _forward_once(
    request: web.Request,
    state: ProxyState,
    adm: _Admitted,
    lease: Lease,
    timeout_s: float,
    priority: int,
) -> RelayResult:
    assert state.session is not None
    cfg = adm.config
    parsed = adm.parsed
    body = dict(parsed.body)
    if lease.backend.cfg.send_priority:
        body["priority"] = priority
    ticket = Ticket(
        tier=adm.tier_name,
        priority=priority,
        tenant=adm.tenant.name,
        deadline=time.time() + timeout_s,
        prefill_share=cfg.prefill_share(adm.tier_name),
        budget=parsed.max_tokens or cfg.limits.max_tokens_ceiling,
        request_id=adm.request_id,
    )
    headers = upstream_headers(request.headers)
    headers["Content-Type"] = "application/json"
    headers["X-Request-Id"] = adm.request_id
    headers[TICKET_HEADER] = encode_ticket(ticket, state.secret)
    loop = asyncio.get_running_loop()
    call = UpstreamCall(
        session=state.session,
        url=lease.backend.cfg.url + _UPSTREAM_PATHS[parsed.endpoint],
        body=orjson.dumps(body),
        headers=headers,
        deadline=loop.time() + timeout_s,
        timeout_s=timeout_s,
        strip_usage_chunk=parsed.stream and not parsed.client_wants_usage,
    )
    result = await relay(call, request, stream=parsed.stream, now=state.clock)
    if result.backend_failed:
        state.pool.record_failure(lease.backend, state.clock())
        state.metrics.backend_errors.labels(lease.backend.label, result.outcome).inc()
    else:
        state.pool.record_success(lease.backend, state.clock())
    return result


def _account(
    state: ProxyState, adm: _Admitted, queued: QueuedRequest, result: RelayResult, lease: Lease
) -> None:
    m = state.metrics
    tier = adm.tier_name
    if result.first_token_at is not None:
        m.ttft.labels(tier).observe(result.first_token_at - adm.arrival)
    usage = result.usage or {}
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        m.tokens.labels(tier, "prompt").inc(prompt)
        m.tokens.labels(tier, "completion").inc(completion)
        state.queue.correct_charge(queued, weighted_tokens(prompt, completion))
    elif result.outcome != "ok":
        # Nothing was generated that we know of: give back the estimate charged at dispatch.
        state.queue.correct_charge(queued, 0.0)


def _log_access(
    state: ProxyState,
    request_id: str,
    who: _Admitted | Tenant | None,
    outcome: str,
    status: int,
    arrival: float,
) -> None:
    elapsed = state.clock() - arrival
    tenant_obj = who.tenant if isinstance(who, _Admitted) else who
    tier = tenant_obj.tier if tenant_obj else "-"
    tenant = tenant_obj.name if tenant_obj else "-"
    if tenant_obj is not None:
        state.metrics.requests.labels(tier, outcome).inc()
    if isinstance(who, _Admitted):
        state.metrics.e2e.labels(tier).observe(elapsed)
    # Never the key: only the tenant it resolved to.
    access_log.info(
        "request_id=%s tenant=%s tier=%s status=%d outcome=%s duration_s=%.3f",
        request_id,
        tenant,
        tier,
        status,
        outcome,
        elapsed,
    )


# -- other endpoints -----------------------------------------------------------------------


def _authenticate(request: web.Request) -> Tenant:
    key = api_key_from(request.headers)
    tenant = request.app[STATE].loaded.tenant_for_key(key) if key else None
    if tenant is None:
        raise unauthorized()
    return tenant


async def _models(request: web.Request) -> web.Response:
    try:
        _authenticate(request)
    except ProxyError as err:
        return err.response()
    state = request.app[STATE]
    assert state.monitor is not None
    cards = await state.monitor.models_payload()
    return web.json_response(
        {"object": "list", "data": cards}, dumps=lambda o: orjson.dumps(o).decode()
    )


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    ready = state.pool.any_available(state.clock())
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.monitor is not None:
        state.monitor.export_gauges()
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _check_admin(request: web.Request) -> ProxyError | None:
    loaded = request.app[STATE].loaded
    if not loaded.admin_key_hashes:
        return ProxyError(
            404, "The admin API is off (no admin_keys in the config).", code="admin_disabled"
        )
    key = api_key_from(request.headers)
    if key is None or not loaded.is_admin_key(key):
        return unauthorized()
    return None


def _backend_view(state: ProxyState, backend: BackendState) -> dict[str, object]:
    now = state.clock()
    load = backend.load
    return {
        "url": backend.cfg.url,
        "name": backend.label,
        "available": backend.available(now),
        "healthy": backend.healthy,
        "draining": backend.draining,
        "ejected_for_s": max(0.0, backend.ejected_until - now),
        "inflight": backend.inflight,
        "max_inflight": backend.cfg.max_inflight,
        "dispatched_total": backend.dispatched_total,
        "models": sorted(backend.models) if backend.models is not None else None,
        "vllm_waiting": load.waiting if load else None,
        "vllm_running": load.running if load else None,
        "metrics_age_s": now - load.at if load else None,
    }


async def _admin_backends(request: web.Request) -> web.Response:
    if (err := _check_admin(request)) is not None:
        return err.response()
    state = request.app[STATE]
    views = [_backend_view(state, b) for b in state.pool.all()]
    return web.json_response({"backends": views})


async def _admin_drain(request: web.Request) -> web.Response:
    """Stop new work to a backend (in-flight work finishes), or take it back."""
    if (err := _check_admin(request)) is not None:
        return err.response()
    state = request.app[STATE]
    try:
        async with asyncio.timeout(_BODY_READ_TIMEOUT_S):
            body = orjson.loads(await request.read())
        url, drain = body["url"], body.get("drain", True)
        if not isinstance(url, str) or not isinstance(drain, bool):
            raise TypeError
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return bad_request('Send {"url": "<backend url>", "drain": true|false}').response()
    backend = state.pool.drain(url, drain)
    if backend is None:
        return ProxyError(404, f"No backend {url!r}", code="unknown_backend").response()
    log.warning("admin: backend %s %s", backend.label, "draining" if drain else "back in service")
    state.dispatcher.kick()
    return web.json_response(_backend_view(state, backend))


async def _unsupported(request: web.Request) -> web.Response:
    err = ProxyError(
        404,
        f"{request.method} {request.path} is not served by tierproxy; it serves"
        " /v1/chat/completions, /v1/completions and /v1/models.",
        type="invalid_request_error",
        code="unknown_url",
    )
    return err.response()


# -- running -----------------------------------------------------------------------------


def serve(config_path: str, *, host: str | None = None, port: int | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    loaded = load_config(config_path)
    app = create_app(loaded, watch_config=True)
    listen = loaded.config.listen
    web.run_app(
        app,
        host=host or listen.host,
        port=port if port is not None else listen.port,
        access_log=None,  # our own access line names tenant and tier, never the key
        handler_cancellation=True,  # a client that leaves cancels its handler: queue + upstream
        backlog=2048,  # bursts of new connections wait in the kernel, not in connect errors
        print=lambda msg: log.info("%s", msg),
    )
