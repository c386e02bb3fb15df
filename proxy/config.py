"""The YAML that ops edit: schema, validation with field paths and line numbers, key hashing."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.config_server import AdminListen, InputLimits, Listen, Relay, Server, Strict
from proxy.config_slo import AdaptiveRoom, TierSlo
from proxy.ticket import DEFAULT_PREFILL_SHARE, DEFAULT_SECRET_ENV
from proxy.yaml_load import Lines, safe_load

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """The stored form of an API key: lowercase hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Limits(Strict):
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # Hard ceiling for any max_tokens a client may ask for, whatever its tier.
    max_tokens_ceiling: int = Field(1_000_000, gt=0)
    # Memory the proxy may hold for accepted requests not yet sent (their parsed bodies,
    # estimated as 6x their bytes: proxy/budget.py); over it, new requests get 503 at once.
    max_held_bytes: int | None = Field(1024 * 1024 * 1024, gt=0)


class Scheduling(Strict):
    # Inside a tenant, short requests go first; a request is never overtaken by one that arrived
    # more than aging_s seconds after it.
    aging_s: float = Field(30.0, gt=0)
    # Cost at which a request counts as "as long as they come" for the short-first order.
    reference_tokens: int = Field(8192, gt=0)
    chars_per_token: float = Field(4.0, gt=0)
    # Expected output when the client sets no max_tokens (the tier cap wins when lower).
    default_expected_output: int = Field(256, gt=0)


class Policies(Strict):
    """Which implementation of each scheduling seam runs (docs/policies.md)."""

    tiers: str = "stride"
    tenants: str = "vtc"
    order: str = "short_first"
    displacement: str = "largest_share"
    backends: str = "least_utilised"
    # backends: prefix_affinity: leading tokens that identify a prompt prefix (approximated
    # with scheduling.chars_per_token), and how many prefixes are remembered.
    prefix_tokens: int = Field(256, gt=0)
    prefix_memory: int = Field(10_000, gt=0)

    @field_validator("tiers", "tenants", "order", "displacement", "backends")
    @classmethod
    def _known(cls, value: str, info: ValidationInfo) -> str:
        # Imported here: the policy modules import the queue, which must not import the config.
        from proxy.policies.registry import CHOICES

        choices = CHOICES[str(info.field_name)]
        if value not in choices:
            raise ValueError(f"unknown policy {value!r}; choose one of: {', '.join(choices)}")
        return value


class BackendHealth(Strict):
    health_interval_s: float = Field(1.0, gt=0)
    metrics_interval_s: float = Field(0.5, gt=0)
    models_interval_s: float = Field(10.0, gt=0)
    # Scraped load older than this is ignored (the proxy's own counts decide alone).
    stale_after_s: float = Field(2.0, gt=0)
    # Requests a backend may hold in its own waiting queue; beyond this its room shrinks by the
    # excess until it drains.
    max_backend_waiting: int = Field(2, ge=0)
    # After an ejection ends, the backend's room ramps from 25% to 100% over this long.
    ramp_s: float = Field(5.0, ge=0)
    eject_base_s: float = Field(1.0, gt=0)
    eject_max_s: float = Field(30.0, gt=0)
    connect_timeout_s: float = Field(3.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    # Consecutive failed /health probes before a backend counts as down (a slow answer from a
    # busy API server is not an outage; refused connections on requests eject at once anyway).
    unhealthy_after: int = Field(3, ge=1)
    # Attempts for a request that has sent nothing to its client yet (refused, reset, 503).
    max_attempts: int = Field(3, ge=1)


class Tier(Strict):
    priority: int
    weight: float = Field(gt=0)
    max_queue: int = Field(ge=0)
    queue_timeout_s: float = Field(gt=0)
    request_timeout_s: float = Field(gt=0)
    max_tokens: int | None = Field(None, gt=0)
    # Share of a vLLM step that this tier's prefills may take while better tiers decode.
    # None: 1.0 for the best tier, 0.2 for the others.
    prefill_share: float | None = Field(None, gt=0, le=1)
    # Latency target (docs/slo.md): goodput metrics, and the adaptive backend room steers by it.
    slo: TierSlo | None = None
    # 429 at once, Retry-After the predicted wait, when a new request's predicted queue wait
    # exceeds queue_timeout_s (false: it waits and gets 503 at the timeout).
    early_refusal: bool = False


class KeySpec(Strict):
    sha256: str | None = None
    env: str | None = None

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256_RE.match(value.lower()):
            raise ValueError("must be 64 hex characters (see `tierproxy hash-key`)")
        return value.lower() if value else value

    @model_validator(mode="after")
    def _exactly_one(self) -> KeySpec:
        if (self.sha256 is None) == (self.env is None):
            raise ValueError("give exactly one of sha256 or env")
        return self


class Tenant(Strict):
    name: str = Field(min_length=1)
    tier: str
    keys: list[KeySpec] = Field(min_length=1)
    weight: float = Field(1.0, gt=0)
    requests_per_minute: float | None = Field(None, gt=0)
    tokens_per_minute: float | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)
    on_limit: Literal["reject", "queue"] = "reject"


class Backend(Strict):
    url: str
    name: str | None = None
    # Unset: the room adapts (docs/slo.md) up to adaptive_room.max_room. Set: a fixed room, or
    # the ceiling of an adaptive one with `adaptive: true`.
    max_inflight: int | None = Field(None, gt=0)
    adaptive: bool | None = None
    # Optional budget of prompt + expected output tokens in flight on this backend.
    max_tokens_inflight: int | None = Field(None, gt=0)
    # Also pass the tier's priority as vLLM's own `priority` (needs --scheduling-policy priority).
    send_priority: bool = True

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8100")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _fixed_needs_a_size(self) -> Backend:
        if self.adaptive is False and self.max_inflight is None:
            raise ValueError("adaptive: false needs max_inflight (the fixed room)")
        return self

    @property
    def label(self) -> str:
        return self.name or self.url

    @property
    def adaptive_room(self) -> bool:
        return self.adaptive if self.adaptive is not None else self.max_inflight is None


class Config(Strict):
    listen: Listen = Listen()
    # Set: /metrics and /admin are served there only, not on `listen`.
    admin_listen: AdminListen | None = None
    server: Server = Server()
    ticket_secret_env: str = DEFAULT_SECRET_ENV
    limits: Limits = Limits()
    scheduling: Scheduling = Scheduling()
    backend_health: BackendHealth = BackendHealth()
    policies: Policies = Policies()
    adaptive_room: AdaptiveRoom = AdaptiveRoom()
    input: InputLimits = InputLimits()
    relay: Relay = Relay()
    tiers: dict[str, Tier] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list)
    backends: list[Backend] = Field(min_length=1)
    # Keys for the /admin endpoints (backend drain); none: the admin API is off.
    admin_keys: list[KeySpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        names: set[str] = set()
        for tenant in self.tenants:
            if tenant.tier not in self.tiers:
                raise ValueError(
                    f"tenant {tenant.name!r} names unknown tier {tenant.tier!r}"
                    f" (tiers: {', '.join(self.tiers)})"
                )
            if tenant.name in names:
                raise ValueError(f"tenant name {tenant.name!r} appears twice")
            names.add(tenant.name)
        admin = self.admin_listen
        if admin is not None and admin.port != 0 and admin.port == self.listen.port:
            raise ValueError("admin_listen must use another port than listen")
        urls = [b.url for b in self.backends]
        if len(set(urls)) != len(urls):
            raise ValueError("a backend url appears twice")
        return self

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

    def tenant_for_key(self, key: str) -> Tenant | None:
        return self.tenant_by_key_hash.get(hash_key(key))

    def is_admin_key(self, key: str) -> bool:
        return hash_key(key) in self.admin_key_hashes


class ConfigError(Exception):
    """Every problem found in one config file, each naming its field and line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _digest_of(spec: KeySpec) -> tuple[str | None, str | None]:
    """(sha256 of the key, None) or (None, the problem)."""
    if spec.env is not None:
        raw = os.environ.get(spec.env)
        if not raw:
            return None, f"environment variable {spec.env} is not set"
        return hash_key(raw), None
    return spec.sha256, None


def _resolve_keys(
    config: Config, lines: Lines
) -> tuple[dict[str, Tenant], frozenset[str], list[str]]:
    by_hash: dict[str, Tenant] = {}
    problems: list[str] = []

    def where(loc: tuple[int | str, ...]) -> str:
        return f"{'.'.join(str(p) for p in loc)} (line {lines.of(loc)})"

    for t_index, tenant in enumerate(config.tenants):
        for k_index, spec in enumerate(tenant.keys):
            loc = ("tenants", t_index, "keys", k_index)
            digest, problem = _digest_of(spec)
            if digest is None:
                problems.append(f"{where(loc)}: {problem}")
                continue
            owner = by_hash.get(digest)
            if owner is not None and owner.name != tenant.name:
                problems.append(f"{where(loc)}: key already belongs to tenant {owner.name!r}")
                continue
            by_hash[digest] = tenant
    admin: set[str] = set()
    for index, spec in enumerate(config.admin_keys):
        digest, problem = _digest_of(spec)
        if digest is None:
            problems.append(f"{where(('admin_keys', index))}: {problem}")
        elif digest in by_hash:
            problems.append(
                f"{where(('admin_keys', index))}: an admin key must not also be a tenant's key"
            )
        else:
            admin.add(digest)
    return by_hash, frozenset(admin), problems


def _missing_env_keys(data: dict[str, Any], lines: Lines) -> list[str]:
    problems = []
    tenants = data.get("tenants")
    for t_index, tenant in enumerate(tenants if isinstance(tenants, list) else []):
        keys = tenant.get("keys") if isinstance(tenant, dict) else None
        for k_index, spec in enumerate(keys if isinstance(keys, list) else []):
            env = spec.get("env") if isinstance(spec, dict) else None
            if isinstance(env, str) and not os.environ.get(env):
                line = lines.of(("tenants", t_index, "keys", k_index))
                problems.append(
                    f"tenants.{t_index}.keys.{k_index} (line {line}):"
                    f" environment variable {env} is not set"
                )
    return problems


# Tenants validated per call. One pydantic call holds the GIL throughout, so a reload parsed in
# a worker thread would stall the event loop for all 10,000 tenants at once (~80 ms) otherwise.
_TENANT_CHUNK = 500
_TENANTS = TypeAdapter(list[Tenant])
_Errors = list[tuple[tuple[int | str, ...], str]]


def _validate(data: dict[str, Any]) -> tuple[Config | None, _Errors]:
    """The config, or None and every error (location, message)."""
    raw = data.get("tenants")
    errors: _Errors = []
    if isinstance(raw, list) and len(raw) > _TENANT_CHUNK:
        tenants: list[Tenant] = []
        for start in range(0, len(raw), _TENANT_CHUNK):
            try:
                tenants += _TENANTS.validate_python(raw[start : start + _TENANT_CHUNK])
            except ValidationError as exc:
                for err in exc.errors():
                    index, *rest = err["loc"]
                    errors.append((("tenants", start + int(index), *rest), err["msg"]))
        # Validated instances are taken as they are: what is left is the rest and cross-checks.
        data = {**data, "tenants": [] if errors else tenants}
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        return None, errors + [(tuple(err["loc"]), err["msg"]) for err in exc.errors()]
    return (None, errors) if errors else (config, errors)


def parse_config(text: str, source: str = "<config>") -> LoadedConfig:
    """Validate YAML text; raises ConfigError listing every problem with its line."""
    try:
        data: Any = safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must be a mapping with tiers, tenants and backends"])
    lines = Lines(text)
    config, errors = _validate(data)
    if config is None:
        problems = []
        for loc, msg in errors:
            path = ".".join(str(p) for p in loc) or "(top level)"
            problems.append(f"{path} (line {lines.of(loc)}): {msg}")
        # Report missing key variables too, so one `tierproxy check` shows everything.
        problems += _missing_env_keys(data, lines)
        raise ConfigError(source, problems)
    by_hash, admin, problems = _resolve_keys(config, lines)
    if problems:
        raise ConfigError(source, problems)
    return LoadedConfig(
        config=config, tenant_by_key_hash=by_hash, admin_key_hashes=admin, source=source
    )


def load_config(path: str | Path) -> LoadedConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read: {exc.strerror}"]) from exc
    return parse_config(text, source=str(p))


def summarize(loaded: LoadedConfig) -> str:
    cfg = loaded.config
    lines = [f"{loaded.source}: ok"]
    lines.append(f"  listen {cfg.listen.host}:{cfg.listen.port}")
    for name, tier in sorted(cfg.tiers.items(), key=lambda kv: kv[1].priority):
        tenants = [t.name for t in cfg.tenants if t.tier == name]
        lines.append(
            f"  tier {name}: priority {tier.priority}, weight {tier.weight:g},"
            f" queue {tier.max_queue}, wait {tier.queue_timeout_s:g}s,"
            f" run {tier.request_timeout_s:g}s, prefill share {cfg.prefill_share(name):g},"
            f" tenants {len(tenants)}"
        )
    lines.append(f"  tenants {len(cfg.tenants)}, keys {len(loaded.tenant_by_key_hash)}")
    for b in cfg.backends:
        ceiling = b.max_inflight or cfg.adaptive_room.max_room
        room = f"adaptive up to {ceiling}" if b.adaptive_room else f"fixed {b.max_inflight}"
        lines.append(f"  backend {b.label}: room {room}")
    return "\n".join(lines)
