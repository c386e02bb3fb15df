"""Per-adapter metrics (docs/adapters.md): requests and tokens by adapter, and the loads,
unloads, load seconds and load failures the proxy made on each backend. vLLM exports nothing
per adapter but ``vllm:lora_requests_info`` (a timestamp): these are the operator's view."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class AdapterMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "tierproxy_adapter_requests",
            "Finished requests for a LoRA adapter of `adapters:`, by adapter and outcome",
            ["adapter", "outcome"],
            registry=r,
        )
        self.tokens = Counter(
            "tierproxy_adapter_tokens",
            "Tokens of a LoRA adapter's requests, by adapter and kind (prompt, output)",
            ["adapter", "kind"],
            registry=r,
        )
        self.loads = Counter(
            "tierproxy_adapter_loads",
            "Adapters the proxy loaded on a backend (POST /v1/load_lora_adapter)",
            ["backend", "adapter"],
            registry=r,
        )
        self.unloads = Counter(
            "tierproxy_adapter_unloads",
            "Adapters the proxy unloaded from a backend to make room for another",
            ["backend", "adapter"],
            registry=r,
        )
        self.load_failures = Counter(
            "tierproxy_adapter_load_failures",
            "Adapter loads that failed (refused, timed out, no answer); each request that"
            " waited on one got 503 adapter_load_failed",
            ["backend", "adapter"],
            registry=r,
        )
        self.unload_failures = Counter(
            "tierproxy_adapter_unload_failures",
            "Adapter unloads that failed (refused, timed out, no answer): the adapter stays"
            " counted as held, and the load that needed its slot is not made",
            ["backend", "adapter"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "tierproxy_adapter_load_seconds",
            "Duration of a successful adapter load on a backend",
            ["adapter"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )

    def loaded(self, backend: str, adapter: str, seconds: float) -> None:
        self.loads.labels(backend, adapter).inc()
        self.load_seconds.labels(adapter).observe(seconds)

    def unloaded(self, backend: str, adapter: str) -> None:
        self.unloads.labels(backend, adapter).inc()

    def failed(self, backend: str, adapter: str, reason: str) -> None:
        self.load_failures.labels(backend, adapter).inc()

    def unload_failed(self, backend: str, adapter: str, reason: str) -> None:
        self.unload_failures.labels(backend, adapter).inc()

    def finished(self, adapter: str, outcome: str, prompt: int, output: int) -> None:
        self.requests.labels(adapter, outcome).inc()
        if prompt:
            self.tokens.labels(adapter, "prompt").inc(prompt)
        if output:
            self.tokens.labels(adapter, "output").inc(output)
