"""Running the proxy — above the request path: config reload (``reload``), usage metering,
its log and reports (``usage``, ``usage_log``, ``usage_report``), the live view
(``live``), `tierproxy keys` editing the config file (``keys``, ``keys_cli``, ``keyedit``,
``keyfile``), the event loop and runtime tuning (``runtime``), ``--workers`` (``workers``), and
local vLLM engines (``engine``, ``process``, ``tiny_model``).

May import ``request``, ``shared`` and every floor below; never ``server``.
"""
