"""Where a prompt whose blocks are unknown goes, for ``backends: kv_aware``: the backend that
last ran a request with the same prompt prefix (``QueuedRequest.prefix_hash``, salted per
tenant), as ``prefix_affinity`` steers. A request gets no blocks when its tokens cannot be had
in time (a backend's /tokenize busy or slow, the tokenizer threads taken): placed by load
alone, a conversation's turn left the engine that held its history (red team: another
tenant's burst of long prompts slowed the engines' /tokenize, and the turns that got no blocks
recomputed up to 800 tokens each).

Learned only from requests that ran, and kept per tenant (``per_tenant`` each, least recently
run dropped first): one tenant's prefixes never push out another's."""

from __future__ import annotations

from collections import OrderedDict


class PrefixHomes:
    def __init__(self, per_tenant: int = 4096) -> None:
        self.per_tenant = per_tenant
        self._homes: dict[str, OrderedDict[int, str]] = {}

    def ran(self, tenant: str, prefix: int | None, url: str) -> None:
        """A request of ``tenant`` with ``prefix`` ran on ``url``."""
        if prefix is None:
            return
        homes = self._homes.setdefault(tenant, OrderedDict())
        homes[prefix] = url
        homes.move_to_end(prefix)
        while len(homes) > self.per_tenant:
            homes.popitem(last=False)

    def home(self, tenant: str, prefix: int | None) -> str | None:
        homes = self._homes.get(tenant)
        return homes.get(prefix) if homes is not None and prefix is not None else None
