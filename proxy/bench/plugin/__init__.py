"""Client-side scenarios and the stock-vs-plugin comparison for the vLLM plugin: requests
(tickets, prompts, timing), gauges (vLLM's /metrics), scenarios, compare (the benchmark)."""
