"""`tiers:` and `tenants:` with their keys (stored as sha256, never in clear)."""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.base import Strict
from proxy.config.quotas import Quota
from proxy.config.slo import TierSlo

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
KEY_ID_DIGITS = 12  # of the sha256: a key's id (48 bits: no clash among one config's keys)


def hash_key(key: str) -> str:
    """The stored form of an API key: lowercase hex sha256 of its UTF-8 bytes. A key read from a
    request header may hold bytes that are not UTF-8 (aiohttp keeps them as lone surrogates):
    those hash to some digest no configured key has (401), never raise (a 500 for anyone)."""
    try:
        raw = key.encode("utf-8", "surrogateescape")  # the bytes the client sent
    except UnicodeEncodeError:  # a surrogate that surrogateescape did not make
        raw = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


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
        " limit); beyond it: 429 `queue_full` at once. With `serve --workers N`: the port's"
        " total, divided among the workers.",
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
    models: list[str] | None = Field(
        None,
        min_length=1,
        description="Models the tier's tenants may use by default: names or globs (`llama-*`)."
        " Any other is answered 404 `model_not_found`, as a model that does not exist, and is"
        " missing from `/v1/models`. null: every model.",
        examples=[["tiny", "llama-3-*"]],
    )
    cache_group: str | None = Field(
        None,
        min_length=1,
        description="Default `cache_group` of the tier's tenants (docs/isolation.md): tenants of"
        " one group share vLLM's prefix cache. null: each tenant has a cache of its own.",
    )
    early_refusal: bool = Field(
        False,
        description="429 at once, Retry-After the predicted wait, when a new request's predicted"
        " queue wait exceeds queue_timeout_s (false: it waits and gets 503 at the timeout).",
    )
    quota: Quota | None = Field(
        None,
        description="Default quota of each of the tier's tenants (each tenant has its own, of"
        " this size; docs/quotas.md). null: none.",
        examples=[{"tokens_per_day": 1000000, "budget_per_month": 200.0}],
    )


def utc_time(value: object) -> object:
    """A YAML date or time as an aware UTC datetime: a date is its midnight, a time without a
    zone is UTC (what `tierproxy keys` writes carries its zone). ValueError where the time
    falls outside datetime's range once in UTC."""
    if isinstance(value, date) and not isinstance(value, datetime):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return value  # pydantic names the problem
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        try:
            return value.astimezone(UTC)
        except OverflowError:  # 9999-12-31T23:59:59-12:00: past datetime's range in UTC
            # A ValueError, so pydantic names the field (an OverflowError escapes validation).
            raise ValueError(
                f"{value.isoformat()} is out of range once converted to UTC (years 1 to 9999)"
            ) from None
    return value


class KeySpec(Strict):
    """One API key: its sha256 (`tierproxy hash-key`) or the variable that holds it; `tierproxy
    keys` adds, rotates and revokes them (docs/keys.md)."""

    sha256: str | None = Field(
        None, description="Lowercase hex sha256 of the key (`echo -n KEY | tierproxy hash-key`)."
    )
    env: str | None = Field(
        None, description="Environment variable that holds the key itself (read at load)."
    )
    id: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{8,64}$",
        description="Short name of the key in `tierproxy keys` and logs: the first hex digits"
        " of its sha256 (`tierproxy keys` writes 12). null: the first 12 of the sha256.",
    )
    created_at: datetime | None = Field(
        None, description="When the key was made (ISO 8601; without a zone: UTC). Informative."
    )
    expires_at: datetime | None = Field(
        None,
        description="From this time on the key is refused (401 `expired_api_key`, 'API key"
        " expired at ...'); ISO 8601, without a zone: UTC. null: never.",
        examples=["2026-06-30T00:00:00Z"],
    )

    @field_validator("created_at", "expires_at", mode="before")
    @classmethod
    def _utc(cls, value: object) -> object:
        return utc_time(value)

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
        if self.id is not None and self.sha256 is not None and not self.sha256.startswith(self.id):
            raise ValueError(f"id {self.id!r} is not the start of the key's sha256")
        return self

    @property
    def key_id(self) -> str:
        """The id `tierproxy keys` shows: ``id``, else the sha256's first 12 digits, else
        ``env:NAME`` (the key itself is known only where the variable is set)."""
        if self.id is not None:
            return self.id
        return self.sha256[:KEY_ID_DIGITS] if self.sha256 is not None else f"env:{self.env}"


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
        description="Rate limit on prompt + output tokens, estimated up front (max_tokens for"
        " each of n choices and each prompt of a prompt list) and corrected from the answer's"
        " usage (a stream without one: what it delivered); a request whose estimate exceeds it"
        " is refused (429 request_over_token_limit, x-should-retry: false), one without"
        " max_tokens gets each sequence's share of it as max_tokens; debt past one"
        " minute's worth is forgiven; null: none.",
    )
    max_concurrent: int | None = Field(
        None, gt=0, description="Requests in flight at once (queued ones not counted); null: none."
    )
    models: list[str] | None = Field(
        None,
        min_length=1,
        description="Models the tenant may use: names or globs (`llama-*`), in place of its"
        " tier's `models`. Any other is answered 404 `model_not_found`, as a model that does"
        " not exist, and is missing from its `/v1/models`. null: the tier's list.",
        examples=[["tiny"]],
    )
    cache_group: str | None = Field(
        None,
        min_length=1,
        description="Tenants with the same group share vLLM's prefix cache (e.g. the apps of one"
        " team and their long system prompt); each other tenant cannot tell, by timing, what"
        " they sent (docs/isolation.md). null: the tier's `cache_group`, else its own cache.",
    )
    on_limit: Literal["reject", "queue"] = Field(
        "reject",
        description="Over a limit: `reject` answers 429 with Retry-After; `queue` waits for the"
        " allowance (within the tier's queue_timeout_s).",
    )
    quota: Quota | None = Field(
        None,
        description="Tokens and money per UTC day and month (docs/quotas.md), in place of its"
        " tier's `quota` (`{}`: none at all). Never waited for, whatever `on_limit` says."
        " null: the tier's.",
        examples=[{"tokens_per_month": 50000000, "budget_per_day": 20.0}],
    )


def cache_scope(tenant: Tenant, tier: Tier) -> str:
    """The prefix-cache scope the tenant's salt is derived from: its group (its own, else its
    tier's), else the tenant alone. Prefixed so that a group never shares with a tenant that is
    merely named like it."""
    group = tenant.cache_group or tier.cache_group
    return f"group:{group}" if group is not None else f"tenant:{tenant.name}"


def cache_groups(tenants: Iterable[Tenant], tiers: Mapping[str, Tier]) -> int:
    """How many cache groups the tenants fall in (their own, else their tier's; a tenant in
    none counts nothing)."""
    return len({g for t in tenants if (g := t.cache_group or tiers[t.tier].cache_group)})


def allowed_models(tenant: Tenant, tier: Tier) -> list[str] | None:
    """The tenant's model patterns (its own, else its tier's); None: every model."""
    return tenant.models if tenant.models is not None else tier.models


def model_allowed(patterns: list[str] | None, model: str) -> bool:
    """Whether ``model`` matches one of ``patterns`` (case-sensitive globs, as model names are);
    every model when there are none."""
    return patterns is None or any(fnmatch.fnmatchcase(model, p) for p in patterns)


def quota_of(tenant: Tenant, tier: Tier) -> Quota | None:
    """The tenant's quota (its own, else its tier's); None: none."""
    return tenant.quota if tenant.quota is not None else tier.quota
