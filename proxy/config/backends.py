"""The `backends:` list and `backend_health:` (probes, ejection, vLLM's own queue)."""

from __future__ import annotations

import re

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.base import TUNING, Strict


class BackendHealth(Strict):
    """How backends are watched (health, load, models), ejected and brought back."""

    health_interval_s: float = Field(
        1.0, gt=0, description="Seconds between active `GET /health` probes of each backend."
    )
    metrics_interval_s: float = Field(
        0.5,
        gt=0,
        description="Seconds between scrapes of each backend's `/metrics` (its load).",
        json_schema_extra=TUNING,
    )
    models_interval_s: float = Field(
        10.0,
        gt=0,
        description="Seconds between refreshes of each backend's `/v1/models`.",
        json_schema_extra=TUNING,
    )
    stale_after_s: float = Field(
        2.0,
        gt=0,
        description="Scraped load older than this is ignored (the proxy's own counts decide"
        " alone).",
        json_schema_extra=TUNING,
    )
    max_backend_waiting: int = Field(
        2,
        ge=0,
        description="Requests a backend may hold in its own waiting queue; beyond this its room"
        " shrinks by the excess until it drains.",
        json_schema_extra=TUNING,
    )
    ramp_s: float = Field(
        5.0,
        ge=0,
        description="After an ejection ends, the backend's room ramps from 25% to 100% over"
        " this long.",
        json_schema_extra=TUNING,
    )
    eject_base_s: float = Field(
        1.0,
        gt=0,
        description="First ejection's length; it doubles with each one in a row.",
        json_schema_extra=TUNING,
    )
    eject_max_s: float = Field(
        30.0, gt=0, description="Longest ejection.", json_schema_extra=TUNING
    )
    connect_timeout_s: float = Field(
        3.0,
        gt=0,
        description="Timeout to open a connection to a backend. Read at start (a restart"
        " applies a change).",
    )
    dead_connection_s: float = Field(
        10.0,
        ge=2.0,
        le=600.0,
        description="A connection to a backend whose host stops answering at the TCP level"
        " (an engine container killed, a node gone: nothing resets the connection) is closed"
        " after this long, and its request retried elsewhere if it has sent its client nothing;"
        " without it such a request waits out its tier's whole limit. TCP keep-alive probes"
        " and TCP_USER_TIMEOUT: a busy engine still acknowledges and is never cut. Read at start.",
        json_schema_extra=TUNING,
    )
    probe_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Timeout of one health, metrics or models probe.",
        json_schema_extra=TUNING,
    )
    max_metrics_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest `/metrics` answer read from a backend (vLLM's is tens of KiB); a"
        " larger one is a failed scrape (cut at the cap, counted in"
        " `tierproxy_backend_probe_failures_total`, its load left to go stale). `/v1/models`"
        " answers are cut at 1 MiB and `/health` ones at 64 KiB.",
        json_schema_extra=TUNING,
    )
    unhealthy_after: int = Field(
        3,
        ge=1,
        description="Consecutive failed /health probes before a backend counts as down (a slow"
        " answer from a busy API server is not an outage; refused connections on requests eject"
        " at once anyway).",
        json_schema_extra=TUNING,
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Attempts for a request that has sent nothing to its client yet (refused,"
        " reset, 503).",
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
        " backend (each request's counted at most to the model's context a sequence); null:"
        " none. A request that fits no backend's budget makes one drain for it: requests of"
        " its tier or worse go elsewhere or wait until it fits (a better tier still passes);"
        " one larger than the whole budget runs once the backend is idle. The best tier counts"
        " only its own tokens while scheduling.best_tier_reserve is above 0 (docs/policies.md).",
    )
    max_cheap_inflight: int = Field(
        4,
        ge=1,
        description="Tokenizer calls (/tokenize, /detokenize) in flight on this backend at"
        " most, apart from max_inflight: they never take a generation's room and never wait"
        " in a queue; past the cap on every backend, 503 backend_busy with Retry-After. One"
        " tenant holds at most half of them on a backend (rounded up), so that one tenant's"
        " slow calls never refuse every other tenant's. With `serve --workers N`: the total,"
        " divided among the workers (at least 1 each).",
    )
    kv_events: str | None = Field(
        None,
        description="ZMQ endpoint of its KV-event publisher, e.g. tcp://10.0.0.5:5557 (with"
        " `kv_cache` on). null: asked from the backend's `GET /kv_event_sources` (a `*` host"
        " there means the backend URL's host).",
    )
    kv_events_replay: str | None = Field(
        None,
        description="With `kv_events`: the ZMQ endpoint of that publisher's replay socket (vLLM's"
        " `replay_endpoint`), which batches missed in a gap, and a new connection's history,"
        " are asked from; its buffer must keep batches (vLLM's `buffer_steps`, 10,000 by"
        " default): a history with none says the engine never stored a block (the index is"
        " exact at once). null: none (from `/kv_event_sources` otherwise).",
        json_schema_extra=TUNING,
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="Its vLLM's --max-loras (run with --enable-lora): distinct LoRA adapters it"
        " runs at once; the proxy never has more in flight there (the rest wait in the proxy's"
        " queue, not in vLLM's). null: it serves no adapter (docs/adapters.md).",
    )
    load_adapters: bool = Field(
        False,
        description="The proxy may load and unload `adapters:` on it at runtime (vLLM with"
        " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); false: only those it lists in /v1/models.",
    )
    adapter_load_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest `POST /v1/load_lora_adapter` (or unload); past it the load failed.",
        json_schema_extra=TUNING,
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
