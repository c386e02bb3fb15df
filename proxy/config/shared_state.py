"""The ``shared_state:`` config section (docs/scale-out.md). Read at start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.base import TUNING, Strict


class SharedState(Strict):
    """Redis shared by the replicas (and ``--workers``) that must act as one proxy."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL (redis:// or rediss://, with the database number).",
    )
    key_prefix: str = Field(
        "tierproxy",
        min_length=1,
        description="Every key this deployment writes starts with it: several deployments may"
        " share a Redis.",
    )
    call_timeout_s: float = Field(
        0.25,
        gt=0,
        description="Each Redis call gives up after this long once it has a connection (then"
        " on_failure decides); timeouts of calls, never waits for a connection, mark Redis"
        " down.",
        json_schema_extra=TUNING,
    )
    pool_wait_s: float = Field(
        1.0,
        gt=0,
        description="A call waits this long for a free connection (a burst past"
        " max_connections; long enough that a burst on a loaded host is still decided by Redis,"
        " since a decision without it lets a tenant past its global limit), then its request is"
        " decided as on_failure says, without marking"
        " Redis down: a busy pool says this process is busy, not that Redis is. A request"
        " waits on Redis at most pool_wait_s + call_timeout_s before it is decided.",
        json_schema_extra=TUNING,
    )
    on_failure: Literal["local", "refuse"] = Field(
        "local",
        description="Redis unreachable: `local` decides with this replica's own limits until"
        " Redis answers again; `refuse` answers new requests 503 with Retry-After.",
    )
    sync_interval_s: float = Field(
        0.1,
        gt=0,
        description="Fairness counters are merged this often (their staleness across replicas"
        " is bounded by it plus one round trip); leases are renewed this often too.",
        json_schema_extra=TUNING,
    )
    lease_ttl_s: float = Field(
        5.0,
        gt=0,
        description="A replica that stops renewing (crashed, cut off) loses its concurrency"
        " slots and backend room after this.",
        json_schema_extra=TUNING,
    )
    max_connections: int = Field(
        16,
        gt=0,
        description="Redis calls at once per process (one connection each; one more carries"
        " the room messages); more concurrent calls wait for one, within pool_wait_s.",
        json_schema_extra=TUNING,
    )
    priority_reserve: int = Field(
        1,
        ge=0,
        description="Slots past a backend's room that, across replicas, only a request of the"
        " best tier may take (the plugin preempts lower tiers inside vLLM, so this over-commit"
        " is safe).",
        json_schema_extra=TUNING,
    )
    probe_interval_s: float = Field(
        0.5,
        gt=0,
        description="While Redis is down, try it again this often.",
        json_schema_extra=TUNING,
    )
