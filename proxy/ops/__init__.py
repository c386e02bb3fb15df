"""Running the proxy — above the request path: config reload (``reload``), usage metering and
its log (``usage``, ``usage_log``), the live view (``live``), the event loop and runtime tuning
(``runtime``), ``--workers`` (``workers``, ``worker_share``) and starting and stopping child
processes (``process``).

May import ``request``, ``replicas`` and every floor below; never ``server`` or ``tools``.
"""
