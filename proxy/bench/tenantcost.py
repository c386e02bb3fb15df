"""Each tenant's own computed share of its prompts: the reading beside the share of all
prompts in the cache-aware benchmarks (``proxy.bench.kvsim.report``, ``proxy.bench.kvbench``).

In a closed loop a placement that gives some tenants an engine to themselves lets them send
many more cheap turns, which lowers the share of all prompts while every other tenant computes
more: averaged with each tenant alike, that shows (docs/benchmarks.md, ``s32045``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def tenant_shares(turns: Iterable[tuple[str, int, int]]) -> dict[str, float]:
    """Each tenant's computed share: its prompts' tokens less their prefix-cache hits, over
    its prompts' tokens, from ``(tenant, prompt tokens, computed tokens)`` of each turn the
    engine ran."""
    prompt: dict[str, int] = {}
    computed: dict[str, int] = {}
    for tenant, tokens, cost in turns:
        if tokens > 0:
            prompt[tenant] = prompt.get(tenant, 0) + tokens
            computed[tenant] = computed.get(tenant, 0) + cost
    return {tenant: computed[tenant] / total for tenant, total in prompt.items()}


def tenant_mean(shares: Mapping[str, float]) -> float:
    """The tenants' shares averaged, each tenant alike (0.0: none)."""
    return sum(shares.values()) / len(shares) if shares else 0.0
