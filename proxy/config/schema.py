"""The whole file (`Config`) and what is derived from it at load time (`LoadedConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import (
    Field,
    model_validator,
)

from proxy.config.adapters import Adapter, adapter_name_ok, adapter_prices
from proxy.config.backends import Backend, BackendHealth
from proxy.config.base import TUNING, Misplaced, Strict
from proxy.config.kv_cache import KvCache
from proxy.config.quotas import Price
from proxy.config.scheduling import Limits, Policies, Scheduling
from proxy.config.server import AdminListen, InputLimits, Listen, Relay, Server
from proxy.config.shared_state import SharedState
from proxy.config.slo import AdaptiveRoom
from proxy.config.tenants import KeySpec, Tenant, Tier, hash_key
from proxy.config.tracing import TracingSettings
from proxy.config.usage_log import UsageLogSettings
from proxy.ticket import DEFAULT_PREFILL_SHARE, DEFAULT_SECRET_ENV


class Config(Strict):
    """The whole file. Most sections apply on a live reload; `listen`, `admin_listen`,
    `server`, `ticket_secret_env`, `shared_state`, `usage_log`, `tracing`,
    `backend_health.connect_timeout_s` and `backend_health.dead_connection_s` are read at start
    (a reload that changes one names it in a warning: a restart applies it)."""

    listen: Listen = Field(Listen(), description="Where clients reach the proxy.")
    admin_listen: AdminListen | None = Field(
        None,
        description="Set: /metrics and /admin are served there only, not on `listen`; /metrics"
        " needs no key there (keep it private). null: both on `listen`, each only with an admin"
        " key (/metrics lists every tenant's usage; Prometheus sends the key as a bearer token).",
        examples=[{"host": "127.0.0.1", "port": 8001}],
    )
    server: Server = Field(Server(), description="Client connections.")
    ticket_secret_env: str = Field(
        DEFAULT_SECRET_ENV,
        description="Environment variable holding the HMAC secret shared with the vLLM plugin"
        " (at least 32 bytes); the proxy refuses to start without it.",
    )
    limits: Limits = Field(Limits(), description="Request size and held memory.")
    scheduling: Scheduling = Field(Scheduling(), description="Short-first order and estimates.")
    backend_health: BackendHealth = Field(
        BackendHealth(), description="Health checks, scraping, ejection, retries."
    )
    policies: Policies = Field(Policies(), description="Scheduling policy of each seam.")
    kv_cache: KvCache = Field(KvCache(), description="Prefix-cache index from vLLM's KV events.")
    adaptive_room: AdaptiveRoom = Field(
        AdaptiveRoom(),
        description="The controller that learns each adaptive backend's room (docs/slo.md).",
        json_schema_extra=TUNING,
    )
    input: InputLimits = Field(InputLimits(), description="What a client may send.")
    relay: Relay = Field(Relay(), description="Bounds on relaying answers.")
    tiers: dict[str, Tier] = Field(min_length=1, description="The tiers, by name.")
    tenants: list[Tenant] = Field(
        default_factory=list, description="Who may call; a key that matches none gets 401."
    )
    backends: list[Backend] = Field(min_length=1, description="The vLLM servers.")
    admin_keys: list[KeySpec] = Field(
        default_factory=list,
        description="Keys for the /admin endpoints (backend drain) and, without `admin_listen`,"
        " for /metrics; none: the admin API is off.",
        examples=[[{"env": "TIERPROXY_ADMIN_KEY"}]],
    )
    shared_state: SharedState | None = Field(
        None,
        description="Set: tenant limits, fairness and backend room are global across the"
        " replicas sharing this Redis (docs/scale-out.md). Read at start.",
        examples=[{"url": "redis://127.0.0.1:6379/0"}],
    )
    pricing: dict[str, Price] = Field(
        default_factory=dict,
        description="Price per million tokens of each model (its name, or a glob: `llama-*`, `*`;"
        " an exact name first, then the globs in order): each usage-log record gets its cost,"
        " and `quota.budget_*` is charged by it (docs/quotas.md). A model without a price"
        " costs nothing.",
        examples=[{"tiny": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}],
    )
    adapters: dict[str, Adapter] = Field(
        default_factory=dict,
        description="LoRA adapters by the name clients send as `model` (docs/adapters.md):"
        " where engines load each from, its base model, who may use it, its price. Backends"
        " with `max_loras` serve them.",
        examples=[
            {"sql-lora": {"path": "/adapters/sql-lora", "base_model": "tiny", "shared": True}}
        ],
    )
    usage_log: UsageLogSettings | None = Field(
        None,
        description="One JSON line per finished request (proxy/ops/usage_log.py); none: off."
        " Read at start.",
        examples=[{"path": "/var/log/tierproxy/usage.jsonl"}],
    )
    tracing: TracingSettings | None = Field(
        None,
        description="OpenTelemetry spans of each request, continued into vLLM (docs/tracing.md);"
        " none: off. Read at start.",
        examples=[{"endpoint": "http://127.0.0.1:4317", "sample_ratio": 0.01}],
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        names: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            if tenant.tier not in self.tiers:
                raise Misplaced(
                    ("tenants", i, "tier"),
                    f"tenant {tenant.name!r} names unknown tier {tenant.tier!r}"
                    f" (tiers: {', '.join(self.tiers)})",
                )
            if tenant.name in names:
                raise Misplaced(
                    ("tenants", i, "name"), f"tenant name {tenant.name!r} appears twice"
                )
            names.add(tenant.name)
        base_models = {a.base_model for a in self.adapters.values()}
        for adapter_name, adapter in self.adapters.items():
            at = ("adapters", adapter_name)
            try:
                adapter_name_ok(adapter_name)
            except ValueError as exc:
                raise Misplaced(at, str(exc)) from None
            if adapter_name in base_models:
                # vLLM refuses to load it, and its catalogue entry would hide the base model
                # from every other tenant (its 404 as for a private adapter).
                raise Misplaced(
                    at,
                    f"adapter {adapter_name!r} has the name of a base model: adapters and"
                    " served models share one name space",
                )
            for j, who in enumerate(adapter.tenants):
                if who not in names:
                    problem = f"adapter {adapter_name!r} names unknown tenant {who!r}"
                    raise Misplaced((*at, "tenants", j), problem)
            for j, tier in enumerate(adapter.tiers):
                if tier not in self.tiers:
                    problem = f"adapter {adapter_name!r} names unknown tier {tier!r}"
                    raise Misplaced((*at, "tiers", j), problem)
        admin = self.admin_listen
        if admin is not None and admin.port != 0 and admin.port == self.listen.port:
            raise Misplaced(("admin_listen",), "admin_listen must use another port than listen")
        urls = [b.url for b in self.backends]
        for j, url in enumerate(urls):
            if url in urls[:j]:
                raise Misplaced(("backends", j, "url"), "a backend url appears twice")
        return self

    @property
    def prices(self) -> dict[str, Price]:
        """`pricing:` with each adapter's own price under its name."""
        return adapter_prices(self.adapters, self.pricing)

    def prefill_share(self, tier: str) -> float:
        explicit = self.tiers[tier].prefill_share
        if explicit is not None:
            return explicit
        best = min(t.priority for t in self.tiers.values())
        return 1.0 if self.tiers[tier].priority == best else DEFAULT_PREFILL_SHARE

    @property
    def lowest_priority(self) -> int:
        """The worst configured priority: what an unticketed request gets in vLLM."""
        return max(t.priority for t in self.tiers.values())


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config plus what was derived from it at load time."""

    config: Config
    tenant_by_key_hash: Mapping[str, Tenant]
    admin_key_hashes: frozenset[str]
    source: str
    # sha256 -> the POSIX time it expires at, for the keys (tenants' and admin) with expires_at.
    key_expires_at: Mapping[str, float] = field(default_factory=dict)
    # What loads but is likely a mistake (a key listed twice): `tierproxy check` prints them.
    warnings: tuple[str, ...] = ()

    def tenant_for_key(self, key: str) -> Tenant | None:
        return self.tenant_by_key_hash.get(hash_key(key))
