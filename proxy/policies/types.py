"""What the mechanism shows the policies: the queued request and its tier's limits, a
backend's scraped load, and a read-only view of a backend. The queue and the pool own these
objects and change them; the policies only read them. Ground floor of ``proxy.policies``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from proxy.policies.cost import weighted_tokens

if TYPE_CHECKING:
    from proxy.config.backends import Backend


class State(Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REMOVED = "removed"  # the client left or the handler gave up
    EXPIRED = "expired"  # waited past its tier's queue timeout
    DISPLACED = "displaced"  # pushed out of a full tier by a tenant with a smaller share


@dataclass(frozen=True)
class TierLimits:
    weight: float
    max_queue: int
    queue_timeout_s: float
    priority: int = 0  # lower is better (for ``tiers: strict_priority``)
    early_refusal: bool = False  # refuse at once a request that would wait past the timeout


@dataclass(eq=False)
class QueuedRequest:
    tier: str
    tenant: str
    prompt_tokens: int
    expected_output: int
    arrival_s: float
    model: str | None = None
    tenant_weight: float = 1.0
    # Hash of the prompt's first tokens (``proxy.policies.prefix``), for backend affinity.
    prefix_hash: int | None = None
    # The proxy's chained hashes of the prompt's full blocks (``proxy.policies.blockhash``),
    # tokens as vLLM sees them with the cache salt folded into the first; the last token is
    # left out (vLLM always computes it), so n blocks cached save n * block_size tokens exactly.
    # None: not computed (kv_cache off, no tokenizer, a prompt not surely rendered as vLLM
    # does). For ``BackendView.cached_blocks``.
    prompt_blocks: tuple[int, ...] | None = None
    # Of those, how many the index of the backend it was sent to held then (set by the pool at
    # dispatch; None: no blocks, or a cold index): logged beside vLLM's cached_tokens.
    predicted_blocks: int | None = None
    # Backends (urls) an earlier attempt failed on before the client got anything: a retry
    # goes elsewhere while another available backend serves its model.
    failed_on: frozenset[str] = frozenset()
    # Set by the queue.
    deadline_s: float = 0.0
    state: State = State.QUEUED
    charged: float = 0.0  # the fairness estimates charged at its dispatches (a retry: again)
    seq: int = -1
    key: float = 0.0
    # The mechanism's handle (a future in the server); the queue never looks at it.
    waiter: Any = field(default=None, repr=False)

    @property
    def cost(self) -> float:
        return weighted_tokens(self.prompt_tokens, self.expected_output)

    def bound_by_context(self, context: int, sequences: int) -> None:
        """No sequence holds more than the model's ``context`` tokens: the prompt's estimate,
        and the output expected of its ``sequences``, capped there (queued work, the token
        budget and kv_aware's booking count no more: a megabyte prompt counted as queued work
        moved others' turns; an expected output past the context, ~31k blocks booked)."""
        self.prompt_tokens = min(self.prompt_tokens, context)
        self.expected_output = min(self.expected_output, context * max(1, sequences))


@dataclass(frozen=True)
class ScrapedLoad:
    waiting: float
    running: float
    kv_usage: float  # 0..1
    at: float  # monotonic time of the scrape
    preemptions: float | None = None  # vLLM's counter since it started; None: not exported
    kv_blocks: float | None = None  # its KV cache in blocks (cache_config_info); None: unknown


class BackendView(Protocol):
    """A backend as the chooser and room policies see it (``proxy.backends.pool.BackendState``
    is the one implementation)."""

    @property
    def cfg(self) -> Backend: ...

    @property
    def inflight(self) -> int: ...

    @property
    def reinstated_at(self) -> float | None: ...

    @property
    def max_room(self) -> float:
        """Requests the backend may hold at once now (before ramps and vLLM's queue)."""

    def available(self, now: float) -> bool:
        """Healthy, not draining, not ejected."""

    def fresh_load(self, now: float, stale_after_s: float) -> ScrapedLoad | None:
        """The scraped load unless older than ``stale_after_s``."""

    def cached_blocks(self, blocks: Sequence[int]) -> int | None:
        """How many leading blocks of ``blocks`` the backend's KV-cache index holds; None when
        it has no index or its index is cold (not synced yet: after a gap, a reconnect or a
        restart of the engine)."""
