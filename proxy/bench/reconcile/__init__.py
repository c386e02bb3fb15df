"""Reconciliation against real vLLM (issue 30 item 6): a hostile mix of requests through
`tierproxy serve` in front of one engine, what the usage log and the quota counters billed
against what the engine counted (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``).

``mix``: the tenants and the planned requests; ``client``: one request sent (or cut);
``ledger``: the figures compared; ``run``: a whole run (the test and benchmarks/reconcile.py).
"""
