"""A load never keeps a request past its tier's queue timeout (red team F8: a hung load held
requests for the backend's `adapter_load_timeout_s`, 30 s, whatever their tier's timeout): the
request waiting for it fails with a clear reason at its deadline while the load goes on for
later requests, and a hung load is given up at its own timeout and counted as a failed load.
Against an engine that accepts the load and never answers it; the loader's clock injected."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.backends.adapter_loader import AdapterEvents, AdapterLoader, AdapterLoadFailed
from proxy.backends.adapter_rules import SlotRules, begin
from proxy.backends.adapter_slots import SlotUser
from proxy.backends.backend import BackendState
from proxy.bench.inproc import serve_app
from proxy.config.adapters import Adapter
from proxy.config.backends import Backend
from tests.helpers.hanging_loads import hanging_load_engine

USER = SlotUser("tenant")
CATALOGUE = {"lora-a": Adapter(path="/adapters/lora-a", base_model="tiny")}


async def test_a_request_stops_waiting_for_a_hung_load_at_its_deadline() -> None:
    began = asyncio.Event()
    failed: list[tuple[str, str, str]] = []
    now = [100.0]
    events = AdapterEvents(failed=lambda *args: failed.append(args))
    async with (
        serve_app(hanging_load_engine(began), handler_cancellation=True) as url,
        aiohttp.ClientSession() as session,
    ):
        cfg = Backend(url=url, max_inflight=4, max_loras=2, load_adapters=True)
        state = BackendState(cfg)  # adapter_load_timeout_s: 30 s
        loader = AdapterLoader(lambda: session, lambda: CATALOGUE, events, lambda: now[0])
        plan = begin(state.adapters, "lora-a", USER, SlotRules(2), now[0])
        # The queue timeout ends 0.05 s from now: the request fails then, not after 30 s.
        with pytest.raises(AdapterLoadFailed, match="queue timeout"):
            await loader.ready(state, "lora-a", plan, deadline=now[0] + 0.05)
        assert "lora-a" in state.adapters.loading  # the load goes on, for the next request
        await asyncio.wait_for(began.wait(), 30)  # it reaches the engine (late on a busy machine)
        assert not failed
        # One whose queue time is already out does not wait at all.
        begin(state.adapters, "lora-a", USER, SlotRules(2), now[0])
        with pytest.raises(AdapterLoadFailed, match="queue timeout"):
            await loader.ready(state, "lora-a", None, deadline=now[0] - 1.0)
        await loader.stop()


async def test_a_hung_load_is_given_up_at_its_timeout_and_counted_as_failed() -> None:
    began = asyncio.Event()
    failed: list[tuple[str, str, str]] = []
    events = AdapterEvents(failed=lambda *args: failed.append(args))
    async with (
        serve_app(hanging_load_engine(began), handler_cancellation=True) as url,
        aiohttp.ClientSession() as session,
    ):
        cfg = Backend(
            url=url, max_inflight=4, max_loras=2, load_adapters=True, adapter_load_timeout_s=0.05
        )
        state = BackendState(cfg)
        loader = AdapterLoader(lambda: session, lambda: CATALOGUE, events)
        plan = begin(state.adapters, "lora-a", USER, SlotRules(2), 0.0)
        with pytest.raises(AdapterLoadFailed, match="timed out"):
            await loader.ready(state, "lora-a", plan)  # no deadline: the load's own timeout
        assert failed == [(state.label, "lora-a", "timed out")]
        assert "lora-a" not in state.adapters.held and not state.adapters.loading
        await loader.stop()
