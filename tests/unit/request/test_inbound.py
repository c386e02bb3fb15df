import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.api.errors import ProxyError
from proxy.config.loader import parse_config
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import Tier, hash_key
from proxy.request.auth import api_key_from, authenticate, authenticate_admin
from proxy.request.headers import upstream_headers
from proxy.request.inbound import (
    nesting_exceeds,
    parse_body,
)

HIGH = Tier(priority=0, weight=10, max_queue=10, queue_timeout_s=10, request_timeout_s=60)
LOW = Tier(
    priority=10, weight=1, max_queue=10, queue_timeout_s=10, request_timeout_s=60, max_tokens=100
)
LIMITS = Limits(max_body_bytes=1000, max_tokens_ceiling=10_000)
SCHED = Scheduling()


def _chat(**extra: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], **extra}
    return orjson.dumps(body)


def _error(raw: bytes, endpoint: str = "chat", tier: Tier = HIGH) -> ProxyError:
    with pytest.raises(ProxyError) as exc:
        parse_body(raw, endpoint, tier, LIMITS, SCHED)  # type: ignore[arg-type]
    return exc.value


def test_client_cannot_raise_its_priority_or_steer_the_engines_caches() -> None:
    remote = {"remote_host": "10.0.0.9", "remote_block_ids": [1, 2], "do_remote_prefill": True}
    raw = _chat(
        priority=-1000,
        vllm_xargs={"tierproxy_priority": -5},
        kv_transfer_params=remote,
        ec_transfer_params=remote,
    )
    parsed = parse_body(raw, "chat", HIGH, LIMITS, SCHED)
    for field in ("priority", "vllm_xargs", "kv_transfer_params", "ec_transfer_params"):
        assert field not in parsed.body
    headers = CIMultiDictProxy(
        CIMultiDict(
            {
                "Authorization": "Bearer k",
                "X-Vllm-Priority": "-1000",
                "x-tierproxy-ticket": "forged",
                "X-Request-Id": "mine",
                "User-Agent": "sdk",
            }
        )
    )
    out = upstream_headers(headers)
    assert dict(out) == {"User-Agent": "sdk"}


def test_estimates_and_clamp() -> None:
    parsed = parse_body(_chat(max_tokens=5000), "chat", LOW, LIMITS, SCHED)
    assert parsed.body["max_tokens"] == 100 and parsed.max_tokens == 100
    assert parsed.prompt_tokens == pytest.approx(102, abs=3)
    assert parsed.expected_output == 100
    unset = parse_body(_chat(), "chat", LOW, LIMITS, SCHED)
    assert unset.body["max_tokens"] == 100  # the tier cap applies when the client sets none
    free = parse_body(_chat(), "chat", HIGH, LIMITS, SCHED)
    assert "max_tokens" not in free.body and free.expected_output == SCHED.default_expected_output


def test_stream_asks_for_usage_and_remembers_whether_client_did() -> None:
    parsed = parse_body(_chat(stream=True), "chat", HIGH, LIMITS, SCHED)
    assert parsed.body["stream_options"] == {"include_usage": True}
    assert parsed.client_wants_usage is False
    asked = parse_body(
        _chat(stream=True, stream_options={"include_usage": True}), "chat", HIGH, LIMITS, SCHED
    )
    assert asked.client_wants_usage is True


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (_chat(max_tokens=-1), "max_tokens"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens="ten"), "max_tokens"),
        (_chat(max_tokens="1e2"), "max_tokens"),
        (_chat(max_tokens=[4]), "max_tokens"),
        (_chat(max_tokens=10**9), "max_tokens"),
        (_chat(max_completion_tokens=2.5), "max_completion_tokens"),
        (_chat(stream="maybe"), "stream"),
        (_chat(stream=2), "stream"),
        (_chat(model=5), "model"),
        (_chat(n=0), "n"),
        (orjson.dumps({"model": "m", "messages": []}), "messages"),
        (orjson.dumps({"model": "m", "messages": [{"content": "no role"}]}), "messages.[0]"),
    ],
)
def test_bad_chat_input_is_a_clear_400(raw: bytes, param: str | None) -> None:
    err = _error(raw)
    assert err.status == 400 and err.param == param
    body = err.body()["error"]
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["message"]


def test_completions_prompt_shapes() -> None:
    ok = [
        {"prompt": "hi"},
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
        {"prompt": [[1, 2], [3]]},
    ]
    for body in ok:
        parse_body(orjson.dumps(body), "completions", HIGH, LIMITS, SCHED)
    for body in [{}, {"prompt": 5}, {"prompt": []}, {"prompt": ["a", 1]}]:
        assert _error(orjson.dumps(body), "completions").param == "prompt"


def test_api_key_sources() -> None:
    assert api_key_from({"Authorization": "Bearer abc "}) == "abc"
    assert api_key_from({"Authorization": "bearer abc"}) == "abc"
    assert api_key_from({"api-key": "xyz"}) == "xyz"
    assert api_key_from({"Authorization": "Basic abc"}) is None
    assert api_key_from({"Authorization": "Bearer "}) is None
    assert api_key_from({}) is None


def _loaded(admin: bool) -> LoadedConfig:
    tenants = [{"name": "t", "tier": "high", "keys": [{"sha256": hash_key("tenant-key")}]}]
    admin_keys = [{"sha256": hash_key("admin-key")}] if admin else []
    config = {
        "tiers": {"high": HIGH.model_dump()},
        "tenants": tenants,
        "backends": [{"url": "http://127.0.0.1:1"}],
        "admin_keys": admin_keys,
    }
    return parse_config(orjson.dumps(config).decode())  # JSON is YAML


def test_authenticate_finds_the_tenant_or_refuses() -> None:
    loaded = _loaded(admin=True)
    assert authenticate({"Authorization": "Bearer tenant-key"}, loaded).name == "t"
    for headers in ({}, {"Authorization": "Bearer admin-key"}, {"api-key": "other"}):
        with pytest.raises(ProxyError) as exc:
            authenticate(headers, loaded)
        assert exc.value.status == 401 and exc.value.code == "invalid_api_key"


def test_authenticate_admin() -> None:
    authenticate_admin({"api-key": "admin-key"}, _loaded(admin=True))
    with pytest.raises(ProxyError) as exc:
        authenticate_admin({"api-key": "tenant-key"}, _loaded(admin=True))
    assert exc.value.status == 401
    with pytest.raises(ProxyError) as exc:
        authenticate_admin({"api-key": "admin-key"}, _loaded(admin=False))
    assert exc.value.status == 404 and exc.value.code == "admin_disabled"


def test_the_estimate_counts_tools_tool_calls_and_names() -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "x" * 400}},
    }
    tools = [{"type": "function", "function": {"name": "weather", "parameters": schema}}]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "y" * 400}}
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "z" * 400},
    ]
    body = orjson.dumps({"model": "m", "messages": messages, "tools": tools})
    parsed = parse_body(body, "chat", HIGH, LIMITS, SCHED)
    plain = orjson.dumps({"model": "m", "messages": messages[:1]})
    # 1,200 characters (300 tokens) past the first message alone
    assert (
        parsed.prompt_tokens >= parse_body(plain, "chat", HIGH, LIMITS, SCHED).prompt_tokens + 300
    )  # 1,200 characters past the plain prompt


def test_deep_nesting_is_refused_without_recursion() -> None:
    deep: object = "x"
    for _ in range(100_000):
        deep = [deep]
    assert nesting_exceeds(deep, 64)
    assert not nesting_exceeds([[["x"]]], 3) and nesting_exceeds([[["x"]]], 2)
    raw = b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 70 + b"]" * 70 + b"}]}"
    err = _error(raw)
    assert err.status == 400 and err.code == "json_too_deep"


def test_nulls_are_absent_also_on_a_capped_tier() -> None:
    parsed = parse_body(_chat(max_tokens=None, n=None, stream=None), "chat", LOW, LIMITS, SCHED)
    assert parsed.body["max_tokens"] == 100 and parsed.stream is False
    assert "n" not in parsed.body


def test_connection_named_and_steering_headers_are_dropped_unless_allowed() -> None:
    headers = CIMultiDictProxy(
        CIMultiDict(
            [
                ("Connection", "keep-alive, X-Secret-Hop"),
                ("X-Secret-Hop", "1"),
                ("Cookie", "session=1"),
                ("Expect", "100-continue"),
                ("X-data-parallel-rank", "0"),
                ("Content-Encoding", "gzip"),
                ("Traceparent", "00-abc"),
            ]
        )
    )
    assert dict(upstream_headers(headers)) == {"Traceparent": "00-abc"}
    allowed = upstream_headers(headers, forward=["cookie", "X-Data-Parallel-Rank", "Expect"])
    assert dict(allowed) == {
        "Cookie": "session=1",
        "X-data-parallel-rank": "0",
        "Traceparent": "00-abc",
    }
