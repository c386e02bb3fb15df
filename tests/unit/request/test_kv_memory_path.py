"""How a request ended reaches kv_aware's placement memory through the request path (the
pipeline's forward releases its lease with ``ran``): what the engine refused (a 4xx) or never
received (a failed connection) leaves no trace; what it ran is kept."""

from __future__ import annotations

from typing import Any

from proxy.bench.fake_vllm import FakeVLLM
from proxy.policies.kvaware import KvAware
from proxy.tools.engine import free_port
from tests.helpers.clock import FakeClock
from tests.helpers.paths import TINY_MODEL_DIR
from tests.helpers.rig import served_rig

KV = {"kv_cache": {"enabled": True, "tokenizer": str(TINY_MODEL_DIR)}}
POLICIES = {"policies": {"backends": "kv_aware"}}
LONG: dict[str, Any] = {"messages": [{"role": "user", "content": "hello there " * 100}]}


def _chooser(chooser: object) -> KvAware:
    assert isinstance(chooser, KvAware)
    return chooser


async def test_a_4xx_leaves_no_trace_and_a_served_request_is_kept(clock: FakeClock) -> None:
    backend = FakeVLLM(status=400)
    async with served_rig(clock, backend, **KV, **POLICIES) as r:
        memory = _chooser(r.state.pool.chooser).memory
        assert (await r.chat(**LONG)).status == 400
        assert memory.kept_by_tenant() == {} and memory.in_flight() == 0
        backend.status = 200
        assert (await r.chat(**LONG)).status == 200
        kept = memory.kept_by_tenant()
        assert kept.keys() == {"tenant-normal"} and kept["tenant-normal"] > 10
        assert memory.in_flight() == 0


async def test_a_backend_that_refused_the_connection_leaves_no_trace(clock: FakeClock) -> None:
    once = {"backend_health": {"max_attempts": 1}}  # refused at once, not retried
    async with served_rig(clock, FakeVLLM(), **KV, **POLICIES, **once) as r:
        (state,) = r.state.pool.all()
        state.cfg = state.cfg.model_copy(update={"url": f"http://127.0.0.1:{free_port()}"})
        answer = await r.chat(**LONG)
        assert answer.status in (502, 503)
        memory = _chooser(r.state.pool.chooser).memory
        assert memory.kept_by_tenant() == {} and memory.in_flight() == 0
