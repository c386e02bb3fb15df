"""A load that failed is not tried again on that backend for FAILED_LOAD_HOLD_S: a request for
the broken adapter meanwhile is refused at once and gives up nobody's idle adapter (red team
2026-12-02, finding 6: each request for an adapter with a bad path unloaded another tenant's
adapter to make room for a load that failed again). A path changed by a reload is tried at once.
Against a server answering vLLM's 400 for a path it cannot read; the loader's clock injected."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from proxy.api.errors import adapter_load_failed
from proxy.backends.adapter_loader import FAILED_LOAD_HOLD_S, AdapterLoader, AdapterLoadFailed
from proxy.backends.adapter_rules import SlotRules, begin
from proxy.backends.adapter_slots import SlotUser
from proxy.backends.backend import BackendState
from proxy.bench.inproc import serve_app
from proxy.config.adapters import Adapter
from proxy.config.backends import Backend

USER = SlotUser("tenant")


def _engine(calls: list[tuple[str, str]]) -> web.Application:
    """vLLM's load and unload routes, noted in ``calls``: a path under /missing is vLLM's 400
    for a path it cannot read, any other loads."""

    async def load(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(("load", body["lora_name"]))
        if body["lora_path"].startswith("/missing"):
            return web.json_response({"error": {"message": "no such path"}}, status=400)
        return web.Response(text="Success")

    async def unload(request: web.Request) -> web.Response:
        calls.append(("unload", (await request.json())["lora_name"]))
        return web.Response(text="Success")

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    return app


async def test_a_failed_load_is_held_back_and_unloads_nobody_meanwhile() -> None:
    calls: list[tuple[str, str]] = []
    app = _engine(calls)
    catalogue = {
        "theirs": Adapter(path="/theirs", base_model="tiny"),
        "broken": Adapter(path="/missing", base_model="tiny"),
    }
    now = [100.0]
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        state = BackendState(Backend(url=url, max_inflight=4, max_loras=1, load_adapters=True))
        loader = AdapterLoader(lambda: session, lambda: catalogue, clock=lambda: now[0])
        await loader.ready(
            state, "theirs", begin(state.adapters, "theirs", USER, SlotRules(1), now[0])
        )
        state.adapters.end("theirs", USER, now[0])  # idle: the one slot's possible victim

        async def ask_for_broken() -> None:
            plan = begin(state.adapters, "broken", USER, SlotRules(1), now[0])
            try:
                await loader.ready(state, "broken", plan)
            finally:
                state.adapters.end("broken", USER, now[0])

        with pytest.raises(AdapterLoadFailed, match="HTTP 400") as failed:
            await ask_for_broken()  # gave up `theirs` for it: the slot was needed
        # Retry-After: the whole hold (red team F4 of round g: the 503 had none at all).
        assert failed.value.retry_after_s == FAILED_LOAD_HOLD_S
        state.adapters.listed(frozenset({"theirs"}), now[0])  # as if `theirs` were still there
        calls.clear()
        for i in range(1, 4):
            now[0] += 5.0
            with pytest.raises(AdapterLoadFailed, match=r"failed \d+ s ago") as held:
                await ask_for_broken()
            assert held.value.retry_after_s == FAILED_LOAD_HOLD_S - 5.0 * i  # what is left
        assert calls == []  # no load tried, nothing unloaded
        assert "theirs" in state.adapters.held

        now[0] += FAILED_LOAD_HOLD_S  # the hold is over: tried again (and fails again)
        with pytest.raises(AdapterLoadFailed, match="HTTP 400"):
            await ask_for_broken()
        assert ("load", "broken") in calls

        catalogue["broken"] = Adapter(path="/fixed", base_model="tiny")  # a reload fixed it
        state.adapters.listed(frozenset(), now[0])
        await ask_for_broken()  # tried at once, though its last load failed a moment ago
        assert "broken" in state.adapters.held


def test_the_503_says_when_to_retry() -> None:
    refused = adapter_load_failed("broken", "its last load here failed 12 s ago", 17.4)
    assert refused.status == 503
    assert refused.headers()["Retry-After"] == "18"
    assert adapter_load_failed("a", "still loading").headers()["Retry-After"] == "1"


async def test_a_tenants_other_broken_adapters_unload_no_other_tenants_adapter() -> None:
    """Red team R3: a tenant asking for three broken adapters in turn (each a new name, so
    each its own hold) unloaded another tenant's idle adapter for each. After its first failed
    load on a backend, its loads there that would give up another tenant's adapter are held
    back for the hold; one that takes a free slot, or gives up its own, is not."""
    calls: list[tuple[str, str]] = []
    app = _engine(calls)
    catalogue = {"theirs": Adapter(path="/theirs", base_model="tiny")} | {
        f"broken-{i}": Adapter(path=f"/missing-{i}", base_model="tiny") for i in range(3)
    }
    peer, low = SlotUser("peer", best=False, rank=10), SlotUser("low", best=False, rank=10)
    rules = SlotRules(1, claim_s=5.0)
    now = [100.0]
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        state = BackendState(Backend(url=url, max_inflight=4, max_loras=1, load_adapters=True))
        loader = AdapterLoader(lambda: session, lambda: catalogue, clock=lambda: now[0])

        async def run(name: str, user: SlotUser) -> None:
            plan = begin(state.adapters, name, user, rules, now[0])
            try:
                await loader.ready(state, name, plan)
            finally:
                state.adapters.end(name, user, now[0])

        failures = []
        for i in range(3):
            await run("theirs", peer)  # the peer's claim kept fresh
            now[0] += 1.0
            with pytest.raises(AdapterLoadFailed) as failed:
                await run(f"broken-{i}", low)
            failures.append(failed.value.reason)
        assert calls.count(("unload", "theirs")) == 1  # on main: 3, one per broken adapter
        assert calls.count(("load", "theirs")) == 2  # the first load, and one reload
        assert "HTTP 400" in failures[0] and "none may unload another's" in failures[1]
        now[0] += FAILED_LOAD_HOLD_S  # the hold is over
        await run("theirs", peer)
        with pytest.raises(AdapterLoadFailed, match="HTTP 400"):
            await run("broken-2", low)
