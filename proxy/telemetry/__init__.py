"""What the proxy tells Prometheus — above policies and relay: the metric families
(``metrics``), the parser of vLLM's ``/metrics`` (``prometheus``) and goodput against the
tiers' SLOs (``slo``).

May import ``policies``, ``relay``, ``config`` and the ground floor.
"""
