"""One GET of a backend's probe route (``/health``, ``/metrics``, ``/v1/models``): within
``probe_timeout_s`` and read up to a cap, so that a broken backend's endless or huge answer
costs the proxy a few MiB at most (vLLM's own ``/metrics`` is tens of KiB); past the cap the
probe fails (``ProbeFailed("oversize")``) and the connection is closed, not drained."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

HEALTH_CAP_BYTES = 64 * 1024  # vLLM answers /health with an empty body
MODELS_CAP_BYTES = 1024 * 1024  # a model card is well under a KiB


class ProbeFailed(Exception):
    """A probe without a usable answer; ``reason``: error, status, oversize, invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    status: int
    body: bytes
    headers: Mapping[str, str]


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or ``ProbeFailed("oversize")`` as soon as it passes ``cap`` bytes."""
    if resp.content_length is not None and resp.content_length > cap:
        raise ProbeFailed("oversize")
    parts: list[bytes] = []
    held = 0
    while chunk := await resp.content.readany():
        held += len(chunk)
        if held > cap:
            raise ProbeFailed("oversize")
        parts.append(chunk)
    return b"".join(parts)


async def probe_get(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float, cap: int
) -> ProbeAnswer:
    """GET ``url``: its status, headers and body (only a 200's body is read)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url) as resp:
                try:
                    body = await read_capped(resp, cap) if resp.status == 200 else b""
                except ProbeFailed:
                    resp.close()  # never drain the rest of a huge answer
                    raise
                return ProbeAnswer(resp.status, body, resp.headers)
    except (TimeoutError, aiohttp.ClientError, OSError):
        raise ProbeFailed("error") from None
