"""The YAML that ops edit — one floor above the ground: one module per section (``base``
holds ``Strict``; ``server``, ``scheduling``, ``backends``, ``tenants``, ``slo``,
``shared_state``, ``usage_log``), the whole file (``schema``), loading with line numbers
(``loader``, ``yaml_load``) and the generated reference (``reference``); ``quotas`` holds
`quota:` and `pricing:`.

May import ``proxy.api``, ``proxy.ticket`` and ``proxy.tasks`` only: policy names are Literal
types here, and a test keeps them equal to ``proxy.policies.registry``.
"""
