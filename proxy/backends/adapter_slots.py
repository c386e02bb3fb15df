"""One backend's LoRA adapters as the proxy sees them: which it holds (listed by its
``/v1/models`` or loaded by the proxy), which are in flight, which are being loaded, and when
each was last used. Pure logic, no I/O: ``proxy.backends.adapter_loader`` does the calls.

A backend with ``max_loras`` M never gets a request whose adapter would make more than M
distinct adapters in flight there: vLLM would hold it in its own "deferred" list, out of the
proxy's sight; here it waits in the proxy's queue, in its tier's order. The proxy also keeps at
most M adapters registered on an engine it loads into, unloading the least recently used idle
one to make room, so that every adapter it holds fits vLLM's adapter cache at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Fit = Literal["has", "load"]


@dataclass(frozen=True)
class LoadPlan:
    """What the request that took the slot must do before it is forwarded: load ``load``,
    after unloading ``unload`` (None: nothing to unload)."""

    load: str
    unload: str | None = None


@dataclass
class AdapterSlots:
    held: dict[str, float] = field(default_factory=dict)  # name -> last used (monotonic)
    loading: set[str] = field(default_factory=set)  # held, but the proxy's load is under way
    unloading: set[str] = field(default_factory=set)  # given up: never routed to, never re-listed
    inflight: dict[str, int] = field(default_factory=dict)  # name -> requests in flight

    def running(self) -> set[str]:
        return {name for name, count in self.inflight.items() if count > 0}

    def listed(self, names: frozenset[str], now: float) -> None:
        """The adapters its ``/v1/models`` lists now (those the proxy is loading stay)."""
        keep = {n: t for n, t in self.held.items() if n in names or n in self.loading}
        for name in names - self.unloading:
            keep.setdefault(name, now)
        self.held = keep

    def victim(self) -> str | None:
        """The least recently used adapter held here with nothing in flight, not loading."""
        running = self.running()
        idle = [(t, n) for n, t in self.held.items() if n not in running and n not in self.loading]
        return min(idle)[1] if idle else None

    def fit(self, adapter: str, max_loras: int, may_load: bool) -> Fit | None:
        """Whether a request for ``adapter`` may start here now: "has" (held, or being
        loaded), "load" (a slot is free or an idle one can be given up), None (it waits)."""
        running = self.running()
        if adapter not in running and len(running) >= max_loras:
            return None
        if adapter in self.held:
            return "has"
        if not may_load:
            return None
        if len(self.held) < max_loras or self.victim() is not None:
            return "load"
        return None

    def begin(self, adapter: str, max_loras: int, now: float) -> LoadPlan | None:
        """Count a request for ``adapter`` in; the load it must do first (None: held)."""
        self.inflight[adapter] = self.inflight.get(adapter, 0) + 1
        if adapter in self.held:
            self.held[adapter] = now
            return None
        unload = self.victim() if len(self.held) >= max_loras else None
        if unload is not None:
            del self.held[unload]
            self.unloading.add(unload)
        self.held[adapter] = now
        self.loading.add(adapter)
        return LoadPlan(adapter, unload)

    def end(self, adapter: str, now: float) -> None:
        """A request for ``adapter`` left."""
        count = self.inflight.get(adapter, 0) - 1
        if count > 0:
            self.inflight[adapter] = count
        else:
            self.inflight.pop(adapter, None)
        if adapter in self.held:
            self.held[adapter] = now

    def load_done(self, adapter: str, ok: bool) -> None:
        self.loading.discard(adapter)
        if not ok:
            self.held.pop(adapter, None)

    def unload_done(self, adapter: str) -> None:
        self.unloading.discard(adapter)

    def gone(self, adapter: str) -> bool:
        """The engine said it does not know ``adapter`` (404): no longer held there, so that
        the next request for it loads it again (a restarted engine, or another replica's
        unload) rather than meet the same 404 until the next ``/v1/models`` probe. True when
        it was counted as held."""
        if adapter in self.loading:
            return False
        return self.held.pop(adapter, None) is not None

    def cancel(self, plan: LoadPlan) -> None:
        """The request that was to carry out ``plan`` left before it began: nothing was loaded
        nor unloaded (the adapter it would have given up is held again, as the oldest)."""
        self.load_done(plan.load, ok=False)
        if plan.unload is not None and plan.unload in self.unloading:
            self.unloading.discard(plan.unload)
            self.held.setdefault(plan.unload, float("-inf"))
