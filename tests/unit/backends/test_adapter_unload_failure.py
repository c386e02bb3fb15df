"""An unload that fails or hangs never lets an engine hold more adapters than its `max_loras`
(red team F2 of round g: a timed-out unload was counted as done, the load went on, and the
engine ended with 3 adapters against 2): the adapter stays counted as held, the load that
needed its slot is not made, the failure is counted by backend and adapter and logged with its
reason; a request waiting on such a plan still ends at its queue timeout. Against a fake
engine in process; the loader's clock injected."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from proxy.backends.adapter_loader import AdapterEvents, AdapterLoader, AdapterLoadFailed
from proxy.backends.adapter_rules import SlotRules, begin
from proxy.backends.adapter_slots import AdapterSlots, SlotUser
from proxy.backends.backend import BackendState
from proxy.bench.inproc import serve_app
from proxy.config.adapters import Adapter
from proxy.config.backends import Backend

USER = SlotUser("tenant")
CATALOGUE = {n: Adapter(path=f"/adapters/{n}", base_model="tiny") for n in ("a", "b", "c")}
RULES = SlotRules(max_loras=2)


def _engine(loaded: set[str], unload_status: int | None) -> web.Application:
    """Holds ``loaded``; its unloads answer ``unload_status`` (None: never answer)."""

    async def load(request: web.Request) -> web.Response:
        loaded.add((await request.json())["lora_name"])
        return web.Response(text="Success")

    async def unload(request: web.Request) -> web.Response:
        if unload_status is None:
            await asyncio.sleep(3600)
        if unload_status == 200:
            loaded.discard((await request.json())["lora_name"])
        return web.Response(status=unload_status or 200, text="engine says no")

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    return app


def _full(state: BackendState) -> None:
    """`a` and `b` held, idle, `a` the least recently used."""
    state.adapters.listed(frozenset({"a"}), 0.0)
    state.adapters.listed(frozenset({"a", "b"}), 1.0)


# The hung unload's timeout short; the answered one's long, so that a busy machine's slow answer
# is not read as a hang (an HTTP 500 came after 0.1 s once, on the full suite).
@pytest.mark.parametrize(
    ("status", "reason", "timeout_s"), [(None, "timed out", 0.1), (500, "HTTP 500", 60.0)]
)
async def test_a_failed_unload_leaves_the_adapter_held_and_loads_nothing(
    status: int | None, reason: str, timeout_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = {"a", "b"}
    unload_failed: list[tuple[str, str, str]] = []
    events = AdapterEvents(unload_failed=lambda *args: unload_failed.append(args))
    async with (
        serve_app(_engine(loaded, status), handler_cancellation=True) as url,
        aiohttp.ClientSession() as session,
    ):
        cfg = Backend(
            url=url,
            max_inflight=4,
            max_loras=2,
            load_adapters=True,
            adapter_load_timeout_s=timeout_s,
        )
        state = BackendState(cfg)
        _full(state)
        loader = AdapterLoader(lambda: session, lambda: CATALOGUE, events)
        plan = begin(state.adapters, "c", USER, RULES, 2.0)
        assert plan is not None and plan.unload == "a"
        with caplog.at_level(logging.WARNING), pytest.raises(AdapterLoadFailed) as err:
            await loader.ready(state, "c", plan)
        assert loaded == {"a", "b"}  # on main: {"a", "b", "c"}, against max_loras 2
        assert set(state.adapters.held) == {"a", "b"}
        assert not state.adapters.loading and not state.adapters.unloading
        assert unload_failed == [(state.label, "a", reason)]
        assert f"unloading adapter a from {state.label} failed: {reason}" in caplog.text
        assert "a" not in str(err.value.reason).split()  # another tenant's adapter: not named
        await loader.stop()


async def test_a_request_waiting_on_a_hung_unload_ends_at_its_queue_timeout() -> None:
    loaded = {"a", "b"}
    now = [100.0]
    async with (
        serve_app(_engine(loaded, None), handler_cancellation=True) as url,
        aiohttp.ClientSession() as session,
    ):
        state = BackendState(Backend(url=url, max_inflight=4, max_loras=2, load_adapters=True))
        _full(state)  # adapter_load_timeout_s: 30 s
        loader = AdapterLoader(lambda: session, lambda: CATALOGUE, clock=lambda: now[0])
        plan = begin(state.adapters, "c", USER, RULES, 2.0)
        with pytest.raises(AdapterLoadFailed, match="queue timeout"):
            await loader.ready(state, "c", plan, deadline=now[0] + 0.05)
        await loader.stop()


def test_a_failed_unload_is_held_again_as_last_used_when_given_up() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"a"}), 0.0)
    slots.listed(frozenset({"a", "b"}), 1.0)
    plan = begin(slots, "c", USER, RULES, 2.0)
    assert plan is not None and plan.unload == "a"
    slots.listed(frozenset({"a", "b"}), 3.0)  # a probe meanwhile does not re-list it
    assert "a" not in slots.held
    slots.unload_done("a", ok=False)
    slots.load_done("c", ok=False)
    assert slots.held == {"a": 0.0, "b": 1.0}
    slots.listed(frozenset({"b"}), 4.0)  # the engine did unload it after all
    assert slots.held == {"b": 1.0}
