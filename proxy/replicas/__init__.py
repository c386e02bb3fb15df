"""Several proxy replicas acting as one through Redis (issue #15) — beside ``request``, above
scheduling: shared tenant limits, shared fairness counters, a shared backend room and the client
that talks to Redis; shared tenant quotas (``quotas``). Absent ``shared_state:`` none of it
runs.

May import ``scheduling`` and every floor below; never ``request``.
"""
