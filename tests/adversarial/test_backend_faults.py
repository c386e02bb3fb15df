"""The backend faults test_relay_faults.py does not play: a backend that dies mid-stream and one
that never answers (the fake vLLM of proxy/bench/fake_vllm.py, also used beside real vLLM in the integration
tests). A refusing or overloaded backend: tests/unit/request/test_pipeline.py."""

from __future__ import annotations

import orjson

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import make_config, until
from tests.helpers.answers import assert_openai_error
from tests.helpers.clock import FakeClock
from tests.helpers.rig import rig, stream_body


async def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_event(
    clock: FakeClock,
) -> None:
    async with (
        FakeVLLM(die_after_events=3).serve() as url,
        rig(make_config([{"url": url}]), clock) as r,
    ):
        resp = await r.chat(stream=True)
        assert resp.status == 200
        events = await stream_body(resp)
        assert len(events) == 5, events  # three chunks, the error, [DONE]
        assert all(b'"object":"chat.completion.chunk"' in e for e in events[:3])
        error = orjson.loads(events[3].removeprefix(b"data: "))["error"]
        assert error["type"] == "server_error" and error["message"]
        assert events[4] == b"data: [DONE]"
        assert r.backend().failures == 1  # counts toward ejection
        assert r.backend().inflight == 0
        await until(lambda: r.requests_total("upstream_error") == 1, 5, "the outcome")


async def test_a_backend_that_never_answers_is_a_504_at_the_request_deadline(
    clock: FakeClock,
) -> None:
    async with FakeVLLM(hang=True).serve() as url:
        config = make_config([{"url": url}], tiers={"normal": {"request_timeout_s": 0.3}})
        async with rig(config, clock) as r:
            resp = await r.chat()
            error = assert_openai_error(resp.status, resp.content_type, await resp.read())
            assert resp.status == 504, error
            assert r.backend().inflight == 0  # the slot is back
