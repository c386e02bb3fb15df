"""The proxy's parts, composed once per process: queue, pool, dispatcher, limits, budget,
usage meter, pipeline and live view, with the reload transaction that changes them in place.

Handlers and endpoints get this object; it holds no route and runs no task (``proxy.server.app``
starts and stops what runs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from proxy.backends.adapter_loader import AdapterEvents, AdapterLoader
from proxy.backends.kvwatcher import KvEventWatcher
from proxy.backends.monitor import BackendMonitor
from proxy.config.kv_cache import KvCache, kv_cache_on
from proxy.config.schema import Config, LoadedConfig
from proxy.ops.live.collector import BackendRoomCollector, TierCollector
from proxy.ops.live.status import LiveStatus
from proxy.ops.reload import ConfigWatcher
from proxy.ops.usage import UsageMeter
from proxy.ops.usage_log import UsageLogWriter
from proxy.relay.budget import MemoryBudget
from proxy.replicas.runtime import SharedRuntime
from proxy.request.pipeline import RequestPipeline
from proxy.request.prompt_blocks import PromptBlocks
from proxy.request.quota_gate import QuotaGate, quota_limits
from proxy.scheduling.build import build_scheduling
from proxy.scheduling.limits import LimitRegistry, TenantLimits, plan_changes
from proxy.scheduling.quotas import QuotaBook, QuotaLedger
from proxy.server.version import VersionCache, fetch_version
from proxy.telemetry.metrics import ProxyMetrics

if TYPE_CHECKING:  # loaded only where tracing is on
    from proxy.telemetry.tracing import Tracing


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
        shared = cfg.shared_state  # read at start: a change needs a restart
        self.shared = (
            SharedRuntime(shared, self.metrics, self.queue, self.pool, self.dispatcher.kick)
            if shared is not None
            else None
        )
        self.limits: TenantLimits = self.shared.limits if self.shared else LimitRegistry()
        self.limits.configure(cfg.tenants, clock())
        self.quota_book: QuotaBook = self.shared.quotas if self.shared else QuotaLedger()
        self._watch_quotas(cfg)
        self.session: aiohttp.ClientSession | None = None
        self.monitor: BackendMonitor | None = None
        self.kv_watcher: KvEventWatcher | None = None  # started by the app (proxy.server.app)
        self.watcher: ConfigWatcher | None = None
        self.metrics.config_generation.set(1)
        self.budget = MemoryBudget(cfg.limits.max_held_bytes)
        self.usage_log = UsageLogWriter(cfg.usage_log) if cfg.usage_log else None  # at start only
        self.tracing = build_tracing(cfg) if cfg.tracing else None  # at start only
        self.usage = UsageMeter(
            self.metrics.registry,
            config=lambda: self.loaded.config,
            models=self.pool.known_models,
            clock=clock,
            sink=self.usage_log.write if self.usage_log is not None else None,
            adapters=self.metrics.adapters,
        )
        self.prompt_blocks = PromptBlocks()  # the tokenizer, loaded once for every request
        self.pipeline = RequestPipeline(
            config=lambda: self.loaded,
            secret=secret,
            clock=clock,
            limits=self.limits,
            queue=self.queue,
            dispatcher=self.dispatcher,
            pool=self.pool,
            metrics=self.metrics,
            session=self.upstream_session,
            budget=self.budget,
            on_finish=self.usage.finished,
            quotas=QuotaGate(
                self.quota_book,
                metrics=self.metrics,
                model_cards=lambda: [state.model_cards for state in self.pool.all()],
            ),
            tracing=self.tracing,
            prompt_blocks=self.prompt_blocks,
        )
        events = self.metrics.adapters
        self.pipeline.adapters.loader = AdapterLoader(
            self.upstream_session,
            lambda: self.loaded.config.adapters,
            AdapterEvents(events.loaded, events.unloaded, events.failed, events.unload_failed),
            clock,
        )
        self.live = LiveStatus(
            config=lambda: self.loaded.config,
            queue=self.queue,
            limits=self.limits,
            pool=self.pool,
            metrics=self.metrics,
            usage=self.usage,
            clock=clock,
            quotas=self.quota_book,
        )
        self.version = VersionCache(
            lambda: fetch_version(
                self.pool, clock, lambda: self.config.backend_health, self.upstream_session
            ),
            clock,
        )
        self.metrics.registry.register(BackendRoomCollector(self.pool, clock))
        self.metrics.registry.register(TierCollector(self.queue, lambda: self.config))
        if self.usage_log is not None:
            self.usage_log.on_drop = self.usage.counters.log_dropped.inc

    @property
    def config(self) -> Config:
        return self.loaded.config

    def kv_settings(self) -> KvCache | None:
        """The ``kv_cache`` section while the prefix-cache indexes run; None: off."""
        cfg = self.config
        return cfg.kv_cache if kv_cache_on(cfg.kv_cache, cfg.policies.backends) else None

    def upstream_session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the app has not started"
        return self.session

    def apply(self, loaded: LoadedConfig) -> None:
        """Swap in a validated config; running requests keep going, and so do queued ones
        that it still allows (``proxy.request.pending``)."""
        self.prepare(loaded)()

    def prepare(self, loaded: LoadedConfig) -> Callable[[], LoadedConfig]:
        """Work out off the event loop (it reads the configs, and loads a newly named
        ``kv_cache.tokenizer``) what ``loaded`` changes; the returned commit applies it on the
        loop in O(changed tenants) and returns the replaced config, for the caller to drop off
        the loop too."""
        base, cfg = self.loaded, loaded.config
        changes = plan_changes(base.config.tenants, cfg.tenants)
        self.prompt_blocks.preload(
            cfg
        )  # a new kv_cache.tokenizer: loaded before it comes into force
        # Weak: the worker thread that ran this may still hold ``commit`` when the caller drops
        # the replaced config, which must then be freed there, off the loop, not by that thread.
        planned_against = weakref.ref(base)
        del base

        def commit() -> LoadedConfig:
            old = self.loaded
            self.scheduling.reconfigure(cfg, changes.names)
            # Who waits for a backend meets the new keys, quotas and tiers now (docs/quotas.md).
            self.pipeline.pending.reload(loaded)
            if old is planned_against():
                self.limits.apply_changes(changes, self.clock())
            else:  # another config came into force meanwhile: the plan is stale
                self.limits.configure(cfg.tenants, self.clock())
            self.budget.limit_bytes = cfg.limits.max_held_bytes
            self._watch_quotas(cfg)
            self.loaded = loaded
            self.metrics.config_generation.inc()
            self.dispatcher.kick()
            return old

        return commit

    def _watch_quotas(self, cfg: Config) -> None:
        """With shared state: the tenants' quota counters each replica keeps a copy of."""
        if self.shared is not None:
            self.shared.quota_copy.watch({t.name: quota_limits(cfg, t) for t in cfg.tenants})


STATE = web.AppKey("tierproxy_state", ProxyState)


def build_tracing(cfg: Config) -> Tracing:
    """The proxy's tracer (``tracing:`` set): OpenTelemetry is imported here, and only here."""
    from proxy.telemetry.tracing import Tracing

    assert cfg.tracing is not None
    return Tracing(cfg.tracing)
