"""What a generation request carries through the pipeline
(``proxy.request.pipeline``): its trace for
the access log, the admitted request with its queue entry, and the seams the pipeline is given
(the relay, the finish hook)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from proxy.api.errors import ProxyError
from proxy.api.hotpath import new_request_id
from proxy.api.outcome import Outcome
from proxy.api.reply_headers import BucketWindow, client_request_id
from proxy.api.routes import BY_ENDPOINT
from proxy.api.usage import TokenUsage, token_usage
from proxy.config.schema import Config
from proxy.config.tenants import Tenant
from proxy.policies.cost import work_tokens
from proxy.policies.prefix import prefix_hash
from proxy.policies.types import QueuedRequest
from proxy.relay.budget import Reservation
from proxy.relay.delivered import Delivered
from proxy.relay.forward import RelayResult
from proxy.request.auth import KEY_ID_CHARS
from proxy.request.billing import Billed
from proxy.request.inbound import ParsedRequest
from proxy.scheduling.quotas import QuotaHold
from proxy.telemetry.slo import Latency

if TYPE_CHECKING:  # OpenTelemetry is loaded only where tracing is on (proxy.telemetry.tracing)
    from proxy.telemetry.spans import RequestSpans


@dataclass
class Trace:
    """What the access log needs, whatever step the request ended in."""

    request_id: str  # the proxy's own (new_request_id): the key of everything
    arrival: float
    client_request_id: str | None = None  # the client's X-Request-Id: echoed and logged only
    tenant: Tenant | None = None  # known once authenticated
    key_hash: str = ""  # its key's sha256, once authenticated (never the key)
    admitted: bool = False  # parsed and its model known
    outcome: Outcome = Outcome.ERROR
    status: int = 500
    latency: Latency | None = None  # of an answer relayed (for goodput)
    spans: RequestSpans | None = None  # its OpenTelemetry spans; None: tracing is off

    @classmethod
    def begin(cls, headers: Mapping[str, str], now: float) -> Trace:
        """A new request's trace: the proxy's own id keys everything; the client's
        X-Request-Id is only echoed and logged."""
        return cls(new_request_id(), now, client_request_id(headers))

    @property
    def key_id(self) -> str:
        """The id logged for its key: the start of its sha256 (``KEY_ID_CHARS``), "-" unknown."""
        return self.key_hash[:KEY_ID_CHARS] or "-"

    @property
    def reply_id(self) -> str:
        """The X-Request-Id of the answers: the client's own echoed, else the proxy's."""
        return self.client_request_id or self.request_id


@dataclass
class Admitted:
    """A request that passed authentication and parsing."""

    config: Config  # the config it was admitted under, kept across reloads
    tenant: Tenant
    parsed: ParsedRequest
    request_id: str
    arrival: float
    queued: QueuedRequest = field(init=False)
    held: Reservation | None = None  # its share of the memory budget
    attempts: int = 0  # backends tried so far
    resets: int = 0  # backends that broke while they may have been running it
    limit_hold: str = ""  # the tenant limits' key for this admission (LimitVerdict.hold)
    # Its tenant's rate-limit windows once admitted: the x-ratelimit-* headers of its stream.
    limit_windows: Mapping[str, BucketWindow] = field(default_factory=dict)
    quota_hold: QuotaHold | None = None  # what its quotas reserved (proxy.request.quota_gate)
    # The model it is billed as and that model's price (proxy.request.quota_gate).
    billed: Billed = field(default_factory=lambda: Billed(None, None))
    # What its stream wrote to the client, counted by the relay: kept here so that a request
    # whose handler is cancelled (the client left) is still billed for it.
    delivered: Delivered = field(default_factory=Delivered)
    cache_salt: str = ""  # the prefix-cache salt of the tenant's scope (derive_cache_salt)
    spans: RequestSpans | None = None  # the trace's (Trace.spans)
    key_hash: str = ""  # its key's sha256: a reload re-checks it (proxy.request.pending)
    # Refused by a reload while it waited outside the queue (its tenant's limit): raised as it
    # would enter the queue (proxy.request.pending).
    refusal: ProxyError | None = None

    @property
    def adapter(self) -> str | None:
        """Its model when that is a LoRA adapter of the catalogue (``adapters:``); else None."""
        model = self.parsed.model
        return model if model is not None and model in self.config.adapters else None

    @property
    def context_model(self) -> str | None:
        """The model whose context (``max_model_len``) bounds it: an adapter's base model
        (vLLM lists an adapter's card only once it is loaded, and without a context), else the
        model it is billed as."""
        adapter = self.adapter
        return self.config.adapters[adapter].base_model if adapter else self.billed.model

    def __post_init__(self) -> None:
        self.queued = QueuedRequest(
            tier=self.tier,
            tenant=self.tenant.name,
            prompt_tokens=self.parsed.prompt_tokens,
            expected_output=self.parsed.expected_output,
            arrival_s=self.arrival,
            model=self.parsed.model,
            tenant_weight=self.tenant.weight,
            # For backend choosers that steer by prompt prefix (a few µs of hashing).
            prefix_hash=prefix_hash(
                self.parsed.body,
                tokens=self.config.policies.prefix_affinity.prefix_tokens,
                chars_per_token=self.config.scheduling.chars_per_token,
                salt=self.cache_salt,
            ),
        )

    @property
    def tier(self) -> str:
        return self.tenant.tier

    @property
    def reserved_tokens(self) -> float:
        """What the tenant's token limit is charged up front (given back once usage is known)."""
        return float(self.parsed.prompt_tokens + self.parsed.expected_output)

    def work(self, counts: TokenUsage) -> float:
        """The fairness charge of ``counts``: weighted tokens, with the prompt tokens vLLM
        found in its prefix cache at ``policies.vtc.cached_prompt_charge`` each (they skipped
        the prefill: a tenant that reuses its prefixes costs the engine less)."""
        charge = self.config.policies.vtc.cached_prompt_charge
        return work_tokens(counts.prompt, counts.cached, counts.completion, charge)

    def billed_usage(self, result: RelayResult | None) -> tuple[TokenUsage | None, Basis]:
        """(the usage to bill, what it rests on: ``proxy.request.admitted.Basis``). The
        backend's usage when it came (whole, or found in the rest of an oversize answer);
        else, never less than the engine ran:

        - ``reservation``: an answer past the relay's size bounds without usage, a non-stream
          answer cut before its usage went by (``RelayResult.usage_lost``), a request the
          tier's limit cut after its backend took it and before its answer
          (``Delivered.deadline_cut``), a Responses stream cut before its last event (its
          events bound nothing: a token without text has none), or a stream that ended while a write
          to its client was waiting (the reader lagged, stopped or left: the engine decodes on
          regardless, how far is unknown): its worst case (the prompt's upper bound and the
          output's, as reserved; what came if more);
        - ``delivered``: a stream that ended without usage (client gone, timeout, backend broke):
          the prompt's upper bound (vLLM ran the whole prompt before its first chunk) and an
          upper bound of the tokens delivered (``Delivered.output_bound``), plus what the engine
          made past the cut before it heard of it (``STEPS_PAST_CUT``);
        - ``client_left``: a non-stream request whose client left while a backend ran it: the
          prompt's upper bound and its expected output (what vLLM decoded before the abort is
          unknown: docs/quotas.md);
        - ``none``: nothing ran that is known of (refused, by the proxy or by vLLM; failed
          before the backend; cut while its connection was still opening)."""
        counts = token_usage(result.usage if result is not None else self.delivered.usage)
        if counts is not None:  # (read before its handler was cancelled: Delivered.usage)
            extra = self.parsed.prompt_billed(counts.prompt) - counts.prompt
            billed = replace(counts, prompt=counts.prompt + extra, total=counts.total + extra)
            return billed, "backend"
        prompt = self.parsed.prompt_billed(self.parsed.prompt_upper_bound)
        worst = self.parsed.output_upper_bound
        worst = self.parsed.expected_output if worst is None else worst
        output = past_the_cut(self.delivered.output_bound, self.parsed.sequences, worst)
        basis: Basis = "delivered"
        cheap = BY_ENDPOINT[self.parsed.endpoint].cheap
        started = result is not None and result.engine_ran and result.first_token_at is not None
        # Cut by its client (the handler cancelled) while a backend had it (its head sent).
        taken = self.delivered.sent and self.delivered.head_sent is not False
        cut = result is None and taken and not cheap
        deadline = self.delivered.deadline_cut and not cheap and result is None  # the 504
        # A Responses stream its client or the tier's limit cut: its events bound nothing (vLLM
        # sends none for a token without text, a special token it skips); nor do the chunks of
        # one with logprobs (``ParsedRequest.text_bounds_tokens``).
        cut_short = result is not None and result.engine_ran and result.outcome in CUT_SHORT
        unbounded = self.parsed.endpoint == "responses" or not self.parsed.text_bounds_tokens
        unbounded = unbounded and (cut or cut_short)
        lost = result is not None and (result.oversize or result.usage_lost)
        if lost or deadline or unbounded or self.delivered.writing:
            output, basis = max(worst, output), "reservation"
        if cut and not self.parsed.stream:
            output, basis = worst, "client_left"
        # A stream that started ran its prompt, whatever it delivered (a Responses stream of
        # tokens without text delivers no event until its last); so did a deadline's cut.
        if output <= 0 and not (cut or started or deadline):
            return None, "none"
        return TokenUsage(prompt, output, prompt + output), basis


# A stream cut without vLLM's usage (its client gone, the deadline): the engine runs on until it
# hears of the cut, a step on the CPU (red team, 2026-12-06: 2 tokens under for n=1, 8 for n=8),
# one more where async scheduling keeps one in flight. One token a step for each sequence
# (speculative decoding makes more a step: not covered, docs/quotas.md).
STEPS_PAST_CUT = 2


def past_the_cut(delivered: int, sequences: int, worst: int) -> int:
    """What the engine made of a stream that delivered ``delivered`` tokens (an upper bound)
    when it was cut: ``STEPS_PAST_CUT`` steps more of each sequence, within its budget
    (``worst``), never less than was delivered; nothing delivered, nothing added."""
    if delivered <= 0:
        return delivered
    return max(delivered, min(worst, delivered + STEPS_PAST_CUT * max(1, sequences)))


# How a relay ends when the proxy or its client cut it (not the backend: it broke, or refused).
CUT_SHORT = frozenset({Outcome.TIMEOUT, Outcome.CLIENT_GONE, Outcome.CLIENT_STALLED})


# What a bill rests on: the backend's own usage, or an estimate that is never below what the
# engine ran (``Admitted.billed_usage``), or nothing billed; the usage log's ``usage_basis``.
Basis = Literal["backend", "delivered", "reservation", "client_left", "none"]
ESTIMATES: frozenset[Basis] = frozenset({"delivered", "reservation", "client_left"})


FinishHook = Callable[[Trace, Admitted | None, RelayResult | None], None]


def no_finish_hook(trace: Trace, adm: Admitted | None, result: RelayResult | None) -> None:
    pass
