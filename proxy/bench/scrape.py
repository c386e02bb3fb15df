"""Reading a server's /metrics over HTTP, and waiting until vLLM holds no request."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from proxy.telemetry.prometheus import vllm_busy


async def fetch_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 2.0, key: str | None = None
) -> str | None:
    """The /metrics text, or None when it is missing or slow. ``key``: the admin key a proxy
    without ``admin_listen`` wants for its /metrics (sent as a bearer token)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        async with session.get(
            f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers
        ) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def wait_idle(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float = 120.0,
    settle_s: float = 0.0,
    poll_s: float = 0.1,
) -> str | None:
    """Wait until vLLM at ``url`` runs and holds waiting nothing (running + waiting == 0 by its
    own gauges), for ``settle_s`` in a row. Returns the /metrics text read at that moment, or
    None when the server has no /metrics or stays busy past ``timeout_s``.

    A starved server may answer /metrics late: a read may take all the time that is left."""
    deadline = time.monotonic() + timeout_s
    idle_since: float | None = None
    while (left := deadline - time.monotonic()) > 0:
        text = await fetch_metrics(session, url, timeout_s=left)
        if text is None:
            return None
        now = time.monotonic()
        if vllm_busy(text):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= settle_s:
            return text
        await asyncio.sleep(poll_s)
    return None
