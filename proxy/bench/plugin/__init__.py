"""Client-side scenarios and the stock-vs-plugin comparison for the vLLM plugin: requests
(tickets, prompts, timing), gauges (vLLM's /metrics),
preconditions (slots filled, retried until it held), scenarios, compare (the benchmark)."""
