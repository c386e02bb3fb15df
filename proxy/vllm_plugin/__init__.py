"""tierproxy's vLLM plugin: runs inside vLLM's processes, imports vLLM (and its
prometheus_client) and of the proxy only its side of the contract, ``proxy.ticket``.

- ``proxy.vllm_plugin.middleware.TicketMiddleware``: ``--middleware`` for the API server;
- ``proxy.vllm_plugin.scheduler.TierScheduler``: ``--scheduler-cls`` for the engine core.

``register()`` is the ``vllm.general_plugins`` entry point, which vLLM runs in every one of its
processes as soon as this package is installed beside it. It therefore changes nothing by
itself: a server uses the plugin only when started with ``proxy.ticket.PLUGIN_FLAGS`` (the
two classes above and ``--scheduling-policy priority``), so other vLLM servers in the same
environment stay stock. One exception, which changes no computation: on x86-64 Linux it asks the
kernel for the AMX tile permission vLLM's CPU attention uses without asking (``cpu_tiles``).
"""

from __future__ import annotations

import logging

from proxy.ticket import PLUGIN_FLAGS
from proxy.vllm_plugin.cpu_tiles import allow_amx_tiles

logger = logging.getLogger("vllm.tierproxy")


_registered = False


def register() -> None:
    """vLLM's general-plugin hook: idempotent, cheap; beyond one debug line it only asks for the
    AMX tile permission (a fresh CPU engine died of SIGILL without it: ``cpu_tiles``)."""
    global _registered
    if _registered:
        return
    _registered = True
    allow_amx_tiles()
    logger.debug("tierproxy plugin installed; enable it with: %s", " ".join(PLUGIN_FLAGS))
