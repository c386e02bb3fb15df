"""Tokenizer calls (``/tokenize``, ``/detokenize``) on the backends: outside the generation
room, bounded by each backend's own small cap and a tenant's share of it, so that one tenant's
slow calls never take every slot and no generation waits for them. vLLM tokenizes in its API
server, not in the engine. Pure logic on the pool's backends."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.backends.backend import BackendState


def take_cheap(
    states: Iterable[BackendState],
    model: str | None,
    now: float,
    tenant: str,
    avoid: frozenset[str],
) -> BackendState | None:
    """The available backend serving ``model`` (none of ``avoid``) with the fewest tokenizer
    calls, below its cap and below ``tenant``'s share of it, counted in; None if none."""
    best: BackendState | None = None
    for state in states:
        if state.cfg.url in avoid or not (state.available(now) and state.serves(model)):
            continue
        if state.cheap_inflight >= state.cfg.max_cheap_inflight:
            continue
        if state.cheap_by_tenant.of(tenant) >= state.cheap_tenant_share:
            continue
        if best is None or state.cheap_inflight < best.cheap_inflight:
            best = state
    if best is not None:
        best.cheap_inflight += 1
        best.cheap_by_tenant.take(tenant)
    return best


def give_back_cheap(state: BackendState, tenant: str) -> None:
    state.cheap_inflight = max(0, state.cheap_inflight - 1)
    state.cheap_by_tenant.give_back(tenant)
