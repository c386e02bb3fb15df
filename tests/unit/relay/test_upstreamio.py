"""open_upstream: what a failure to reach the backend is called (and so whether it is retried)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from proxy.relay.delivered import Delivered
from proxy.relay.result import UpstreamUnavailable
from proxy.relay.upstreamio import open_upstream


def _call(error: Exception) -> Any:
    async def post(*args: object, **kwargs: object) -> None:
        raise error

    session = SimpleNamespace(post=post)
    return SimpleNamespace(session=session, url="u", body=b"", headers={}, delivered=Delivered())


async def test_a_connect_timeout_is_the_backend_unreachable_not_the_tiers_limit() -> None:
    # aiohttp's ConnectionTimeoutError is also a TimeoutError: caught as the tier's 504 before.
    with pytest.raises(UpstreamUnavailable) as caught:
        await open_upstream(_call(aiohttp.ConnectionTimeoutError("connect timed out")))
    assert caught.value.kind == "connect" and not caught.value.maybe_ran


async def test_a_reset_while_sending_may_have_run() -> None:
    with pytest.raises(UpstreamUnavailable) as caught:
        await open_upstream(_call(aiohttp.ServerDisconnectedError()))
    assert caught.value.kind == "reset"
