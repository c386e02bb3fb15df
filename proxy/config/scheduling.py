"""The scheduling sections: `limits:` (request and memory bounds), `scheduling:` (cost
estimates, aging) and `policies:` (which implementation of each seam runs)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from proxy.config.base import TUNING, Strict
from proxy.config.deprecated import nest_flat_policy_knobs


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
        " bodies, reserved before they are read at 6x their bytes, grown to what the parsed body"
        " measures where that is more: its text plus a cost per value, object and array,"
        " proxy/request/jsonshape.py; and buffered answers until sent: proxy/relay/budget.py);"
        " over it, new requests get 503"
        " at once. null: no bound. With `serve --workers N`: the total, divided among the workers.",
    )


class AdapterSlotKnobs(Strict):
    """`scheduling.adapter_slots`: how an engine's LoRA adapter slots (its `max_loras`) are
    shared among tiers and tenants (docs/adapters.md). vLLM cannot preempt an adapter: a slot
    given to a long generation is gone until it ends, so these hold slots back before the
    request that would need them arrives."""

    best_tier_reserve: int = Field(
        1,
        ge=0,
        le=64,
        description="Slots of each engine's `max_loras` that worse tiers never open: their"
        " requests run at most `max_loras` minus this many distinct adapters there (more"
        " requests for an adapter they already run are let in), so a best-tier request for"
        " another adapter never waits behind worse tiers' generations. Kept only for a base"
        " model some best-tier tenant may use an adapter of, and never the engine's last slot"
        " (an engine with `max_loras: 1` keeps none). 0: slots go to the first request of any"
        " tier.",
    )
    tenant_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The share of an engine's `max_loras` one tenant may take while another"
        " tenant wants a slot there (has a request running there, or used an adapter there in"
        " the last `claim_s`): at most max(1, share x max_loras) distinct adapters of its"
        " requests run there at once, and once it holds that many it makes room for another"
        " of its adapters by giving up one of its own idle adapters, not another tenant's."
        " Alone on an engine a tenant may use every slot. 1: no bound.",
    )
    claim_s: float = Field(
        5.0,
        gt=0,
        description="How long after its last request on an adapter a tenant still claims it:"
        " another tenant at its share may not give it up, and a tenant of the same tier or"
        " a worse one counts it as wanted (holding itself to its share). A worse tier's idle"
        " claim never keeps a better tier waiting. Short on purpose: it only spares a tenant"
        " that comes back within it a reload caused by another tenant's cycling (one load per"
        " gap at most otherwise), and keeps a peer tier's request waiting at most this long.",
        json_schema_extra=TUNING,
    )
    locality_wait_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="How long, from its arrival, a request for an adapter that is not loaded"
        " waits rather than unload an idle adapter that another tenant's next queued request"
        " (of its tier or a better one) wants: that request runs on the adapter held instead"
        " of one load now and a reload for it. Usually the other request goes in the same"
        " dispatch pass and nobody waits; the bound only matters when it cannot run yet."
        " 0: adapters are given up in the queue's order.",
        json_schema_extra=TUNING,
    )
    due_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The share of its tier's `queue_timeout_s` after which a request waiting"
        " for an adapter slot is due: on the engines where it waits, nobody joins or starts"
        " an adapter ahead of it, and it may unload any idle adapter, one a better tier"
        " claims included. So better tiers that keep every slot busy hold a worse tier's"
        " adapter request this long, not to its timeout (a 503). 1: strict tier order.",
    )


class Scheduling(Strict):
    """Inside a tenant, short requests go first, with aging (the `short_first` order); the
    best tier's reserve past a backend's room."""

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
        json_schema_extra=TUNING,
    )
    chars_per_token: float = Field(
        4.0,
        gt=0,
        description="Characters per token, to estimate a prompt's tokens cheaply.",
        json_schema_extra=TUNING,
    )
    default_expected_output: int = Field(
        256,
        gt=0,
        description="Expected output tokens when the client sets no max_tokens (the tier cap"
        " wins when lower).",
        json_schema_extra=TUNING,
    )
    best_tier_reserve: int = Field(
        1,
        ge=0,
        le=64,
        description="Slots past each backend's room that only a request of the best tier (the"
        " lowest `priority`) may take, and only while worse tiers run at least as many"
        " requests there: a worse tier's long generations that fill the room cannot hold the"
        " best tier in the proxy's queue. The vLLM plugin preempts a worse-tier request for"
        " each (docs/plugin.md), so vLLM never runs more than the room; without the plugin the"
        " request waits in vLLM's queue instead. Above 0, a best-tier request also counts only"
        " the best tier's tokens against a backend's max_tokens_inflight. 0: the room and the"
        " token budget are hard caps for every tier.",
    )
    adapter_slots: AdapterSlotKnobs = Field(
        default_factory=AdapterSlotKnobs,
        description="How LoRA adapter slots are shared among tiers and tenants.",
    )


# The names of each seam's implementations (``proxy.policies.registry`` builds them; a test keeps
# the two in step, so the config needs no import of the policies).
TierPolicy = Literal["stride", "strict_priority"]
TenantPolicy = Literal["vtc", "edf"]
OrderPolicy = Literal["short_first", "fcfs"]
DisplacementPolicy = Literal["largest_share", "none"]
BackendPolicy = Literal["least_utilised", "prefix_affinity", "kv_aware"]


class PrefixAffinityKnobs(Strict):
    """`policies.prefix_affinity`: how a prompt prefix is recognised and remembered."""

    prefix_tokens: int = Field(
        256,
        gt=0,
        description="Leading tokens that identify a prompt prefix (approximated with"
        " `scheduling.chars_per_token`).",
    )
    memory: int = Field(10_000, gt=0, description="How many prefixes are remembered (LRU).")


class KvAwareKnobs(Strict):
    """`policies.kv_aware`: free room against cached prefill, and the hold for a busy cache."""

    room_weight_best: float = Field(
        0.5,
        gt=0,
        description="How much the best tier weighs a backend's free room against the share of"
        " its prompt cached there (1.0: a fully cached prompt is worth a whole idle backend);"
        " higher sends it to idle backends sooner. 0.5 held best across the family of"
        " workloads of docs/benchmarks.md (1.0: with every engine busy, a turn left its"
        " cache for a moment's free slot, and the prefill it computed again was load every"
        " request waited behind).",
    )
    room_weight_worst: float = Field(
        0.1,
        gt=0,
        description="The same weight for the worst tier (tiers between: geometric steps by"
        " priority); lower lets it follow its cache onto busier backends.",
    )
    hold_s: float = Field(
        10.0,
        ge=0,
        le=30,
        description="The longest a worst-tier request waits for the busy backend that holds"
        " its prompt's prefix while another has room (better tiers wait less, in proportion to"
        " their room weights; never past half the tier's `queue_timeout_s`; 0: never waits,"
        " moves at once). 10 s held best across the family of workloads of docs/benchmarks.md"
        " (3 s: with engines busy, a turn left its tenant's cache for a free slot and computed"
        " its system prompt again; 1 s moved long conversations off their cache).",
    )
    work_weight: float = Field(
        0.5,
        ge=0,
        description="How much the best tier weighs a token of prefill queued ahead of it on a"
        " backend (sent there by the proxy, not yet shown done by the backend's KV events; a"
        " request decoding counts a few tokens) against a token of prefill that backend's cache"
        " saves it (worse tiers less, in proportion to their room weights; 0: queued work"
        " counts only as the room it takes). 0.5 held best across the family of workloads of"
        " docs/benchmarks.md (0.25 left longer best-tier tails; 1 moved conversations off"
        " their caches).",
    )
    memory_blocks: int = Field(
        65_536,
        ge=1,
        description="How many (backend, block) pairs the chooser remembers of where it sent"
        " prompts that ran (their homes), and how many shared prefixes' homes, each shared"
        " between tenants: past it, the tenant keeping the most loses its oldest.",
        json_schema_extra=TUNING,
    )


class VtcKnobs(Strict):
    """`policies.vtc`: what the fairness counters charge."""

    cached_prompt_charge: float = Field(
        0.1,
        ge=0,
        le=1,
        description="What one prompt token that hit the backend's prefix cache costs in the"
        " fairness counters, against 1.0 for one it computed (needs vLLM's"
        " `--enable-prompt-tokens-details`; without it every prompt token counts 1.0).",
    )


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
        description="Which backend gets a request: `least_utilised` (most room),"
        " `prefix_affinity` (the one that served the same prompt prefix, when it has room) or"
        " `kv_aware` (prefill saved by what each backend's KV cache holds, against its load).",
    )
    prefix_affinity: PrefixAffinityKnobs = Field(
        PrefixAffinityKnobs(),
        description="`backends: prefix_affinity`'s knobs (also the prefix hash every request"
        " carries).",
        json_schema_extra=TUNING,
    )
    kv_aware: KvAwareKnobs = Field(
        KvAwareKnobs(), description="`backends: kv_aware`'s knobs.", json_schema_extra=TUNING
    )
    vtc: VtcKnobs = Field(
        VtcKnobs(), description="`tenants: vtc`'s knobs.", json_schema_extra=TUNING
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_knobs(cls, data: Any) -> Any:
        """The flat names of before 2026-12 (`kv_hold_s`, ...), moved under their policy;
        the loader logs a deprecation warning for each (proxy/config/deprecated.py)."""
        return nest_flat_policy_knobs(data)
