"""What the proxy knows about each backend — above telemetry, below scheduling: the backends
and their room (``pool``, ``backend``), outlier detection (``health``), one bounded GET of a
probe route (``probes``), the metrics monitor (``monitor``, with each backend's clock offset:
``clock_offset``), per-tenant counts held on a backend (``counts``), and the KV index of the
blocks each engine holds, fed by vLLM's KV events (``kvevents``, ``kvindex``, ``kvreplay``,
``kvsources``, ``kvsubscriber``, ``kvwatcher``).

May import ``telemetry``, ``policies``, ``relay``, ``config`` and the ground floor; never
``scheduling``, which decides who runs where from what this floor knows.
"""
