"""The adapter loader's stop (the proxy's shutdown; proxy.backends.adapter_loader): a request
still waiting on a load gets a clear failure rather than a bare cancellation, the slot the load
held is given back, and no load starts once the loader has stopped. Against an engine that
accepts the load and never answers it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.backends.adapter_loader import AdapterLoader, AdapterLoadFailed
from proxy.backends.adapter_rules import SlotRules, begin
from proxy.backends.adapter_slots import LoadPlan, SlotUser
from proxy.backends.backend import BackendState
from proxy.bench.inproc import serve_app
from proxy.config.adapters import Adapter
from proxy.config.backends import Backend
from tests.helpers.hanging_loads import hanging_load_engine

USER = SlotUser("tenant")

CATALOGUE = {n: Adapter(path=f"/adapters/{n}", base_model="tiny") for n in ("lora-a", "lora-b")}


async def test_stop_fails_the_waiters_gives_the_slot_back_and_refuses_new_loads() -> None:
    began = asyncio.Event()
    async with (
        serve_app(hanging_load_engine(began), handler_cancellation=True) as url,
        aiohttp.ClientSession() as s,
    ):
        state = BackendState(Backend(url=url, max_inflight=4, max_loras=2, load_adapters=True))
        loader = AdapterLoader(lambda: s, lambda: CATALOGUE)
        plan = begin(state.adapters, "lora-a", USER, SlotRules(2), 0.0)
        assert plan == LoadPlan("lora-a")
        first = asyncio.create_task(loader.ready(state, "lora-a", plan))
        # A second request for it: it waits.
        begin(state.adapters, "lora-a", USER, SlotRules(2), 0.0)
        second = asyncio.create_task(loader.ready(state, "lora-a", None))
        async with asyncio.timeout(10):
            await began.wait()
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        await loader.stop()
        for waiter in (first, second):
            with pytest.raises(AdapterLoadFailed, match="stopping"):
                await waiter
        assert "lora-a" not in state.adapters.held and not state.adapters.loading
        late = begin(state.adapters, "lora-b", USER, SlotRules(2), 1.0)
        assert late is not None
        with pytest.raises(AdapterLoadFailed, match="stopping"):
            await loader.ready(state, "lora-b", late)
        assert "lora-b" not in state.adapters.held  # its plan cancelled, nothing loading
        await loader.stop()  # idempotent
