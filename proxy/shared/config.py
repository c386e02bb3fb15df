"""The ``shared_state:`` config section (docs/scale-out.md). Read at start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config_server import Strict


class SharedState(Strict):
    """Redis shared by the replicas (and ``--workers``) that must act as one proxy."""

    url: str = "redis://127.0.0.1:6379/0"
    # Every key this deployment writes starts with it: several deployments may share a Redis.
    key_prefix: str = Field("tierproxy", min_length=1)
    # Each Redis call gives up after this long (then on_failure decides); a request never
    # waits on Redis longer than one such timeout before it is decided.
    call_timeout_s: float = Field(0.25, gt=0)
    # Redis unreachable: ``local`` decides with this replica's own limits until Redis answers
    # again; ``refuse`` answers new requests 503 with Retry-After.
    on_failure: Literal["local", "refuse"] = "local"
    # Fairness counters are merged this often (their staleness across replicas is bounded by
    # it plus one round trip); leases are renewed this often too.
    sync_interval_s: float = Field(0.1, gt=0)
    # A replica that stops renewing (crashed, cut off) loses its concurrency slots after this.
    lease_ttl_s: float = Field(5.0, gt=0)
    # Connections to Redis per process; more concurrent calls wait for one (within the timeout).
    max_connections: int = Field(16, gt=0)
    # Slots past a backend's max_inflight that, across replicas, only a request of the best
    # tier may take (the plugin preempts lower tiers inside vLLM, so this over-commit is safe).
    priority_reserve: int = Field(1, ge=0)
    # While Redis is down, try it again this often.
    probe_interval_s: float = Field(0.5, gt=0)
