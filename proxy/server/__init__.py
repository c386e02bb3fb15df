"""The process edge — above ops: the composition of the parts (``state``), the aiohttp
app, its routes and lifecycle (``app``), the listeners with their connection cap
(``listeners``), the non-model routes (``endpoints``), ``/admin`` (``admin``) and JSON errors
for what aiohttp itself refuses (``json_errors``).

May import every floor below it; only ``proxy.cli`` and ``proxy.bench`` import it.
"""
