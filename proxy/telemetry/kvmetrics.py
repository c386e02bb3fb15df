"""Metrics of the per-backend prefix-cache indexes fed by vLLM's KV events
(``proxy.backends.kvevents``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KvIndexMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.blocks = Gauge(
            "tierproxy_kv_index_blocks",
            "Blocks the proxy's index of a backend's prefix cache holds",
            ["backend"],
            registry=r,
        )
        self.warm = Gauge(
            "tierproxy_kv_index_warm",
            "1 when the chooser uses a backend's prefix-cache index (its trust is 1 or 2; 0:"
            " cold, no connection to its KV events)",
            ["backend"],
            registry=r,
        )
        self.trust = Gauge(
            "tierproxy_kv_index_trust",
            "How far a backend's prefix-cache index is trusted: 2 exact (heard from the"
            " engine's first batch, a replay of it, or an AllBlocksCleared), 1 partial (lacks"
            " blocks stored before it joined or before a gap; never over-predicts), 0 cold",
            ["backend"],
            registry=r,
        )
        self.events = Counter(
            "tierproxy_kv_events",
            "KV events applied, by backend and kind (BlockStored, BlockRemoved, AllBlocksCleared)",
            ["backend", "kind"],
            registry=r,
        )
        self.gaps = Counter(
            "tierproxy_kv_event_gaps",
            "Batches of KV events missed (a gap in sequence numbers, a reconnect): the backend's"
            " index was dropped",
            ["backend"],
            registry=r,
        )
        self.errors = Counter(
            "tierproxy_kv_event_errors",
            "KV-event batches (or subscribers) that failed: the backend's index was dropped and"
            " resyncs (the log says why)",
            ["backend"],
            registry=r,
        )
        self.refused = Counter(
            "tierproxy_kv_events_refused",
            "KV events not of vLLM's shapes (block hashes, token ids), skipped",
            ["backend"],
            registry=r,
        )
        self.replayed = Counter(
            "tierproxy_kv_events_replayed_batches",
            "KV-event batches missed and brought back from the engine's replay socket (the"
            " index stayed in sync)",
            ["backend"],
            registry=r,
        )
        self.restarts = Counter(
            "tierproxy_kv_event_restarts",
            "Engine restarts seen in a backend's KV events (its sequence numbers began again):"
            " the backend's index was cleared",
            ["backend"],
            registry=r,
        )
        self.lag = Gauge(
            "tierproxy_kv_event_lag_seconds",
            "Age of the last KV-event batch applied when it was applied (the engine's timestamp"
            " against this host's clock)",
            ["backend"],
            registry=r,
        )
        self.evicted = Counter(
            "tierproxy_kv_index_evicted_blocks",
            "Blocks dropped from a backend's index for its memory bound (kv_cache.max_blocks)",
            ["backend"],
            registry=r,
        )
        self.connected = Gauge(
            "tierproxy_kv_event_subscribed",
            "1 while a subscriber to the backend's KV events runs on a known endpoint",
            ["backend"],
            registry=r,
        )
