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
    field_validator,
    model_validator,
)

from proxy.config.server import AdminListen, InputLimits, Listen, Relay, Server, Strict
from proxy.config.shared_state import SharedState
from proxy.config.slo import AdaptiveRoom, TierSlo
from proxy.config.usage_log import UsageLogSettings
from proxy.config.yaml_load import Lines, safe_load, yield_gil
from proxy.ticket import DEFAULT_PREFILL_SHARE, DEFAULT_SECRET_ENV

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """The stored form of an API key: lowercase hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Limits(Strict):
    """What one request may ask for and what the proxy holds for all of them."""

    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest request body (after decoding gzip/deflate); larger: 413.",
    )
    max_tokens_ceiling: int = Field(
        1_000_000,
        gt=0,
        description="Hard ceiling for any max_tokens a client may ask for, whatever its tier.",
    )
    max_held_bytes: int | None = Field(
        1024 * 1024 * 1024,
        gt=0,
        description="Memory the proxy may hold for accepted requests not yet sent (their"
        " parsed bodies, estimated as 6x their bytes: proxy/relay/budget.py); over it, new requests"
        " get 503 at once. null: no bound.",
    )


class Scheduling(Strict):
    """Inside a tenant, short requests go first, with aging (the `short_first` order)."""

    aging_s: float = Field(
        30.0,
        gt=0,
        description="A request is never overtaken by one that arrived more than this many"
        " seconds after it.",
    )
    reference_tokens: int = Field(
        8192,
        gt=0,
        description='Cost at which a request counts as "as long as they come" for the'
        " short-first order.",
    )
    chars_per_token: float = Field(
        4.0, gt=0, description="Characters per token, to estimate a prompt's tokens cheaply."
    )
    default_expected_output: int = Field(
        256,
        gt=0,
        description="Expected output tokens when the client sets no max_tokens (the tier cap"
        " wins when lower).",
    )


# The names of each seam's implementations (``proxy.policies.registry`` builds them; a test keeps
# the two in step, so the config needs no import of the policies).
TierPolicy = Literal["stride", "strict_priority"]
TenantPolicy = Literal["vtc", "edf"]
OrderPolicy = Literal["short_first", "fcfs"]
DisplacementPolicy = Literal["largest_share", "none"]
BackendPolicy = Literal["least_utilised", "prefix_affinity"]


class Policies(Strict):
    """Which implementation of each scheduling seam runs (docs/policies.md)."""

    tiers: TierPolicy = Field(
        "stride",
        description="Which tier goes next: `stride` shares picks by tier weight"
        " (work-conserving); `strict_priority` always serves the best waiting tier.",
    )
    tenants: TenantPolicy = Field(
        "vtc",
        description="Which tenant of a tier goes next: `vtc` (least weighted tokens served)"
        " or `edf` (earliest deadline).",
    )
    order: OrderPolicy = Field(
        "short_first",
        description="Order inside a tenant: `short_first` (with `scheduling.aging_s`) or `fcfs`.",
    )
    displacement: DisplacementPolicy = Field(
        "largest_share",
        description="What a full tier does with a newcomer: `largest_share` drops the newest"
        " request of the tenant holding the largest weighted share (its client gets the 429);"
        " `none` refuses the newcomer.",
    )
    backends: BackendPolicy = Field(
        "least_utilised",
        description="Which backend gets a request: `least_utilised` (most room) or"
        " `prefix_affinity` (the one that served the same prompt prefix, when it has room).",
    )
    prefix_tokens: int = Field(
        256,
        gt=0,
        description="`prefix_affinity`: leading tokens that identify a prompt prefix"
        " (approximated with `scheduling.chars_per_token`).",
    )
    prefix_memory: int = Field(
        10_000, gt=0, description="`prefix_affinity`: how many prefixes are remembered (LRU)."
    )


class BackendHealth(Strict):
    """How backends are watched (health, load, models), ejected and brought back."""

    health_interval_s: float = Field(
        1.0, gt=0, description="Seconds between active `GET /health` probes of each backend."
    )
    metrics_interval_s: float = Field(
        0.5, gt=0, description="Seconds between scrapes of each backend's `/metrics` (its load)."
    )
    models_interval_s: float = Field(
        10.0, gt=0, description="Seconds between refreshes of each backend's `/v1/models`."
    )
    stale_after_s: float = Field(
        2.0,
        gt=0,
        description="Scraped load older than this is ignored (the proxy's own counts decide"
        " alone).",
    )
    max_backend_waiting: int = Field(
        2,
        ge=0,
        description="Requests a backend may hold in its own waiting queue; beyond this its room"
        " shrinks by the excess until it drains.",
    )
    ramp_s: float = Field(
        5.0,
        ge=0,
        description="After an ejection ends, the backend's room ramps from 25% to 100% over"
        " this long.",
    )
    eject_base_s: float = Field(
        1.0, gt=0, description="First ejection's length; it doubles with each one in a row."
    )
    eject_max_s: float = Field(30.0, gt=0, description="Longest ejection.")
    connect_timeout_s: float = Field(
        3.0, gt=0, description="Timeout to open a connection to a backend."
    )
    probe_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of one health, metrics or models probe."
    )
    unhealthy_after: int = Field(
        3,
        ge=1,
        description="Consecutive failed /health probes before a backend counts as down (a slow"
        " answer from a busy API server is not an outage; refused connections on requests eject"
        " at once anyway).",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Attempts for a request that has sent nothing to its client yet (refused,"
        " reset, 503).",
    )


class Tier(Strict):
    """One service tier: its place in vLLM's priority order, its share and its bounds."""

    priority: int = Field(
        description="vLLM priority of the tier's requests; lower is better (the best tier"
        " preempts the others in the plugin's scheduler)."
    )
    weight: float = Field(
        gt=0, description="Share of dispatches while tiers compete (`policies.tiers: stride`)."
    )
    max_queue: int = Field(
        ge=0,
        description="Requests that may wait in the tier (queued plus waiting for a tenant"
        " limit); beyond it: 429 `queue_full` at once.",
    )
    queue_timeout_s: float = Field(
        gt=0, description="Longest wait in the queue; then 503 `queue_timeout` with Retry-After."
    )
    request_timeout_s: float = Field(
        gt=0,
        description="Longest run upstream; then 504, or an error event and [DONE] inside a stream.",
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description="Cap on a request's max_tokens (clamped, not refused); null: no tier cap.",
    )
    prefill_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of a vLLM step that this tier's prefills may take while better tiers"
        " decode. null: 1.0 for the best tier, 0.2 for the others.",
    )
    slo: TierSlo | None = Field(
        None,
        description="Latency target (docs/slo.md): goodput metrics, and the adaptive backend"
        " room steers by it.",
        examples=[{"ttft_s": 1.0, "itl_s": 0.1, "percentile": 99}],
    )
    early_refusal: bool = Field(
        False,
        description="429 at once, Retry-After the predicted wait, when a new request's predicted"
        " queue wait exceeds queue_timeout_s (false: it waits and gets 503 at the timeout).",
    )


class KeySpec(Strict):
    """One API key: its sha256 (`tierproxy hash-key`) or the variable that holds it."""

    sha256: str | None = Field(
        None, description="Lowercase hex sha256 of the key (`echo -n KEY | tierproxy hash-key`)."
    )
    env: str | None = Field(
        None, description="Environment variable that holds the key itself (read at load)."
    )

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
    """A team or application: its keys, its tier, its share and limits inside the tier."""

    name: str = Field(min_length=1, description="Unique name (in logs and metrics).")
    tier: str = Field(description="Name of one of `tiers`.")
    keys: list[KeySpec] = Field(min_length=1, description="API keys that identify the tenant.")
    weight: float = Field(
        1.0, gt=0, description="Share against the other tenants of its tier (fairness)."
    )
    requests_per_minute: float | None = Field(
        None, gt=0, description="Rate limit on requests (token bucket); null: none."
    )
    tokens_per_minute: float | None = Field(
        None,
        gt=0,
        description="Rate limit on prompt + output tokens, estimated up front and corrected"
        " from the answer's usage; null: none.",
    )
    max_concurrent: int | None = Field(
        None, gt=0, description="Requests in flight at once (queued ones not counted); null: none."
    )
    on_limit: Literal["reject", "queue"] = Field(
        "reject",
        description="Over a limit: `reject` answers 429 with Retry-After; `queue` waits for the"
        " allowance (within the tier's queue_timeout_s).",
    )


class Backend(Strict):
    """One stock vLLM OpenAI server."""

    url: str = Field(description="Base URL of the vLLM server, e.g. http://127.0.0.1:8100.")
    name: str | None = Field(None, description="Label in logs and metrics; null: the URL.")
    max_inflight: int | None = Field(
        None,
        gt=0,
        description="Requests in flight on this backend at most. Unset: the room adapts"
        " (docs/slo.md) up to adaptive_room.max_room. Set: a fixed room (keep it near vLLM's"
        " --max-num-seqs), or the ceiling of an adaptive one with `adaptive: true`.",
    )
    adaptive: bool | None = Field(
        None,
        description="Learn the room from vLLM's queue and the tiers' SLOs; null: adaptive"
        " exactly when max_inflight is unset.",
    )
    max_tokens_inflight: int | None = Field(
        None,
        gt=0,
        description="Optional budget of prompt + expected output tokens in flight on this"
        " backend; null: none.",
    )
    send_priority: bool = Field(
        True,
        description="Also pass the tier's priority as vLLM's own `priority` (needs"
        " --scheduling-policy priority).",
    )

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
    """The whole file. Most sections apply on a live reload; `listen`, `admin_listen` and
    `server` are read at start."""

    listen: Listen = Field(Listen(), description="Where clients reach the proxy.")
    admin_listen: AdminListen | None = Field(
        None,
        description="Set: /metrics and /admin are served there only, not on `listen`.",
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
    adaptive_room: AdaptiveRoom = Field(
        AdaptiveRoom(),
        description="The controller that learns each adaptive backend's room (docs/slo.md).",
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
        description="Keys for the /admin endpoints (backend drain); none: the admin API is off.",
        examples=[[{"env": "TIERPROXY_ADMIN_KEY"}]],
    )
    shared_state: SharedState | None = Field(
        None,
        description="Set: tenant limits, fairness and backend room are global across the"
        " replicas sharing this Redis (docs/scale-out.md). Read at start.",
        examples=[{"url": "redis://127.0.0.1:6379/0"}],
    )
    usage_log: UsageLogSettings | None = Field(
        None,
        description="One JSON line per finished request (proxy/ops/usage_log.py); none: off."
        " Read at start.",
        examples=[{"path": "/var/log/tierproxy/usage.jsonl"}],
    )

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
_TENANT_CHUNK = 100
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
                yield_gil()  # see proxy.config.yaml_load.YIELD_EVERY
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
