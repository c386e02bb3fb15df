"""`tierproxy bench`: an open-loop, mixed-tenant load generator and its report.

One module per job: ``scenario`` (the declarative files), ``arrivals`` and ``plan`` (what is sent
when), ``client`` (one streaming request), ``runner`` (the open loop), ``capacity`` (the
saturation step), ``stats`` and ``report`` (numbers), ``plots``, ``proxy_config`` (a proxy config
that holds a scenario's keys), ``stack`` (a local engine plus proxy), ``args`` and ``cli``.

Top floor with ``proxy.cli``: may import every package below.
"""
