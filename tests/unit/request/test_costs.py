"""Per-route input costs, vLLM's lax reading of numbers, and the headers' formats."""

from __future__ import annotations

import pytest

from proxy.api.errors import ProxyError
from proxy.api.reply_headers import openai_duration, ratelimit_headers, request_id_for
from proxy.api.routes import Endpoint
from proxy.config.tenants import Tenant
from proxy.request.costs import lax_bool, lax_int, usage_counts
from proxy.request.route_table import ROWS
from proxy.scheduling.limits import LimitRegistry


def _tenant(rpm: int, tpm: int) -> Tenant:
    return Tenant(
        name="t",
        tier="low",
        keys=[{"sha256": "0" * 64}],
        requests_per_minute=rpm,
        tokens_per_minute=tpm,
    )


def test_each_route_charges_its_own_inputs() -> None:
    assert ROWS["embeddings"].measure({"input": ["abcd", "ef"]}) == 6
    assert ROWS["embeddings"].measure({"input": [[1, 2, 3]]}) == 12  # token ids: ~1 each
    assert ROWS["pooling"].measure({"messages": [{"role": "user", "content": "hey"}]}) == 7
    responses = {"input": "abcd", "instructions": "xy", "tools": [{"name": "f"}]}
    assert ROWS["responses"].measure(responses) == 4 + 2 + len("name") + 1
    # Score and rerank: the one query meets every document.
    assert ROWS["score"].measure({"text_1": "qq", "text_2": ["aaa", "b"]}) == 2 * 2 + 4
    assert ROWS["score"].measure({"text_1": ["qq", "r"], "text_2": ["aaa", "b"]}) == 3 + 4
    assert ROWS["score"].measure({"queries": "q", "documents": ["ab"]}) == 1 + 2
    assert ROWS["rerank"].measure({"query": "qq", "documents": ["a", "bb", "c"]}) == 6 + 4
    assert ROWS["tokenize"].measure({"prompt": "hello"}) == 5
    assert ROWS["detokenize"].measure({"tokens": [1, 2]}) == 8


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("embeddings", {}, "input"),
        ("responses", {"instructions": "x"}, "input"),
        ("rerank", {"documents": ["a"]}, "query"),
        ("score", {"text_1": "a"}, "data_2"),
        ("detokenize", {}, "tokens"),
    ],
)
def test_a_missing_input_is_a_400(route: Endpoint, body: dict[str, object], param: str) -> None:
    with pytest.raises(ProxyError) as exc:
        ROWS[route].measure(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_numbers_and_booleans_read_as_pydantic_reads_them() -> None:
    read: list[tuple[object, int]] = [("4", 4), (" 4 ", 4), ("4.0", 4), (4.0, 4), (True, 1)]
    for value, expected in read:
        assert lax_int(value) == expected, value
    refused: list[object] = [4.5, "1e2", "four", [4], None, "0x10"]
    for bad in refused:
        assert lax_int(bad) is None, bad
    assert [lax_bool(v) for v in ("true", "Yes", "off", 1, 0, False)] == [
        True,
        True,
        False,
        True,
        False,
        False,
    ]
    assert lax_bool(2) is None and lax_bool("maybe") is None


def test_usage_of_every_route_shape() -> None:
    assert usage_counts({"prompt_tokens": 5, "completion_tokens": 2}) == (5, 2)
    assert usage_counts({"prompt_tokens": 5, "total_tokens": 5}) == (5, 0)  # embeddings
    assert usage_counts({"input_tokens": 6, "output_tokens": 4}) == (6, 4)  # responses
    assert usage_counts({"total_tokens": 9}) == (9, 0)
    assert usage_counts({"prompt_tokens": -1}) is None and usage_counts(None) is None


def test_request_ids_kept_only_when_plain() -> None:
    assert request_id_for({"X-Request-Id": "abc-1.2:3"}) == "abc-1.2:3"
    for bad in ("", "a b", "x" * 129, "é", "a\r\nb"):
        assert request_id_for({"X-Request-Id": bad}) != bad


def test_durations_as_openai_writes_them() -> None:
    assert openai_duration(0.02) == "20ms"
    assert openai_duration(1.5) == "1.5s"
    assert openai_duration(360) == "6m0s"
    assert openai_duration(3723) == "1h2m3s"


def test_ratelimit_headers_from_the_buckets() -> None:
    limits = LimitRegistry()
    limits.configure([_tenant(rpm=120, tpm=600)], now=0.0)
    assert limits.try_admit("t", 300, now=0.0).allowed
    headers = ratelimit_headers(limits.windows("t", now=0.0))
    assert headers == {
        "x-ratelimit-limit-requests": "120",
        "x-ratelimit-remaining-requests": "119",
        "x-ratelimit-reset-requests": "500ms",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "300",
        "x-ratelimit-reset-tokens": "30s",
    }
    assert limits.windows("t", now=30.0)["tokens"].remaining == 600
    assert limits.windows("nobody", now=0.0) == {}
