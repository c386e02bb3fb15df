"""What the proxy tells Prometheus and a trace collector — above policies and relay: the metric
families (``metrics``), the parser of vLLM's ``/metrics`` (``prometheus``), goodput against the
tiers' SLOs (``slo``) and OpenTelemetry spans (``tracing``, ``spans``: loaded only where
tracing is on).

May import ``policies``, ``relay``, ``config`` and the ground floor.
"""
