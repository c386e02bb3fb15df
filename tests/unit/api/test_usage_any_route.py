"""Usage is read in one place (proxy.api.usage) whatever route answered: a /v1/responses answer
(``input_tokens``/``output_tokens``), streamed or not, is billed in the per-tenant counters, the
usage log and the tenant's token limit like a chat answer (issue 22: it was billed 0/0)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.usage import TokenUsage, token_usage
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.config.loader import parse_config
from proxy.config.tenants import hash_key
from proxy.relay import sse
from proxy.server.app import create_app
from proxy.server.state import STATE
from tests.helpers.clock import FakeClock

BODY = {"model": "tiny", "input": "hello", "max_output_tokens": 4}
# A Responses answer's usage, as vLLM writes it (the fake below reports 6 in, 4 out).
RESPONSES_USAGE = {"input_tokens": 6, "output_tokens": 4, "total_tokens": 10}


def test_every_usage_shape_reads_the_same() -> None:
    assert token_usage({"prompt_tokens": 3, "completion_tokens": 2}) == TokenUsage(3, 2, 5)
    assert token_usage(RESPONSES_USAGE) == TokenUsage(6, 4, 10)
    assert token_usage({"total_tokens": 9}) == TokenUsage(9, 0, 9)  # rerank
    assert token_usage({"input_tokens": True}) is None and token_usage(None) is None
    assert token_usage({"prompt_tokens": 3, "completion_tokens": -1}) == TokenUsage(3, 0, 3)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_responses_answer_is_billed_everywhere(
    clock: FakeClock, tmp_path: Path, stream: bool
) -> None:
    log_path = tmp_path / "usage.jsonl"
    async with FakeVLLM(usage=(6, 4)).serve() as url:
        tenant = {
            "name": "tenant-high",
            "tier": "high",
            "keys": [{"sha256": hash_key("key-high")}],
            "tokens_per_minute": 1000,
        }
        config = make_config([{"url": url}], tenants=[tenant], usage_log={"path": str(log_path)})
        app = create_app(parse_config(yaml.safe_dump(config)), secret=SECRET, clock=clock)
        state = app[STATE]
        async with TestClient(TestServer(app)) as client:
            body = {**BODY, "stream": stream}
            async with client.post("/v1/responses", json=body, headers=auth("high")) as resp:
                assert resp.status == 200
                if stream:
                    events = [e async for e in sse.read_events(resp.content)]
                    assert events[-1].startswith(b"event: response.completed")
                else:
                    await resp.read()
            tokens = state.usage.counters.tokens
            labels = ("tenant-high", "high", "tiny", "ok")
            await until(lambda: tokens.labels(*labels, "prompt")._value.get() == 6, 5, "billed")
            assert tokens.labels(*labels, "completion")._value.get() == 4
            assert state.usage.tokens_by_tenant[("tenant-high", "high")] == 10
            # The tenant's token limit: charged the usage (10), not the reservation.
            window = state.limits.windows("tenant-high", clock())["tokens"]
            assert window.remaining == pytest.approx(990, abs=1)
        # The usage log is written once the app stops (its writer thread drains then).
        (line,) = log_path.read_text().splitlines()
        record = orjson.loads(line)
        assert (record["prompt_tokens"], record["completion_tokens"]) == (6, 4)
