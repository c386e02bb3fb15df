"""Run the real proxy app in-process for integration tests: proxy.bench.inproc, plus a poll."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.app import ProxyState
from proxy.bench.inproc import KEYS, SECRET, auth, make_config, running_proxy

__all__ = ["KEYS", "SECRET", "auth", "make_config", "running_proxy", "until"]


async def until(
    condition: Callable[[], bool],
    timeout_s: float = 30.0,
    what: str = "",
    state: ProxyState | None = None,
) -> None:
    """Poll a condition on running servers; fail (never hang) when it does not come true,
    saying what the proxy held at that moment."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            held = ""
            if state is not None:
                held = f"; queue {len(state.queue)}, backends {state.pool.all()}"
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{held}")
        await asyncio.sleep(0.01)
