"""The per-route table: a row for every route, the body-field rules on every route, and a
prompt bound that no body undercuts (issue 30 items 1-2, issue 31's first bullet)."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from proxy.api.errors import ProxyError
from proxy.api.routes import BY_ENDPOINT, Endpoint
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.tenants import Tier
from proxy.relay.forward import relay
from proxy.relay.responses import relay_responses
from proxy.request.inbound import parse_body
from proxy.request.route_table import ROWS

TIER = Tier(priority=5, weight=5, max_queue=64, queue_timeout_s=60, request_timeout_s=120)
ROUTES: tuple[Endpoint, ...] = get_args(Endpoint)

MINIMAL: dict[Endpoint, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "completions": {"prompt": "hi"},
    "responses": {"input": "hi", "store": False},
    "embeddings": {"input": "hi"},
    "pooling": {"input": "hi"},
    "classify": {"input": "hi"},
    "score": {"text_1": "a", "text_2": "b"},
    "rerank": {"query": "a", "documents": ["b"]},
    "tokenize": {"prompt": "hi"},
    "detokenize": {"tokens": [1, 2]},
}


def parse(endpoint: Endpoint, **extra: object) -> dict[str, Any]:
    raw = json.dumps({"model": "tiny", **MINIMAL[endpoint], **extra}).encode()
    return parse_body(raw, endpoint, TIER, Limits(), Scheduling()).body


def test_every_route_has_a_row_and_only_routes_do() -> None:
    assert set(ROWS) == set(ROUTES) == set(BY_ENDPOINT)


def test_only_generating_routes_have_an_output_budget() -> None:
    for endpoint in ROUTES:
        assert bool(ROWS[endpoint].budget_fields) == BY_ENDPOINT[endpoint].generates, endpoint


def test_responses_relay_their_own_events_the_others_the_plain_relay() -> None:
    assert ROWS["responses"].relay is relay_responses
    assert all(ROWS[e].relay is relay for e in ROUTES if e != "responses")


@pytest.mark.parametrize("endpoint", ROUTES)
@pytest.mark.parametrize(
    "name", ["session_id", "priority", "vllm_xargs", "cache_salt", "kv_transfer_params",
             "ec_transfer_params", "request_id", "stream_interval"]
)  # fmt: skip
def test_engine_fields_never_pass_as_sent(endpoint: Endpoint, name: str) -> None:
    assert name not in parse(endpoint, **{name: {"x": "y" * 1000}})
    assert name not in parse(endpoint, **{name: "x" * 7_000_000 if name == "session_id" else 1})


@pytest.mark.parametrize("endpoint", ROUTES)
def test_user_and_metadata_are_bounded(endpoint: Endpoint) -> None:
    assert parse(endpoint, user="u" * 256, metadata={"k": "v" * 512})["user"] == "u" * 256
    refused: list[dict[str, object]] = [
        {"user": "u" * 257},
        {"user": {"id": 1}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {str(i): "v" for i in range(17)}},
        {"metadata": {"k": {"nested": 1}}},
    ]
    for extra in refused:
        with pytest.raises(ProxyError) as exc:
            parse(endpoint, **extra)
        assert exc.value.status == 400 and str(exc.value.param).split(".")[0] in extra, extra


@pytest.mark.parametrize("endpoint", ROUTES)
def test_beam_search_is_refused_its_work_is_not_its_usage(endpoint: Endpoint) -> None:
    """Fresh eyes, 2026-12-06: vLLM's beam search runs a request per beam per token and
    reports the prompt once (25 billed for 59,625 run): refused, not billed under."""
    assert parse(endpoint, use_beam_search=False)["use_beam_search"] is False
    with pytest.raises(ProxyError) as exc:
        parse(endpoint, use_beam_search=True)
    assert (exc.value.status, exc.value.param) == (400, "use_beam_search")
    assert exc.value.code == "unmetered_field"


@pytest.mark.parametrize("endpoint", ROUTES)
def test_unknown_fields_pass_as_small_scalars_only(endpoint: Endpoint) -> None:
    body = parse(endpoint, my_flag=True, my_num=1.5, my_tag="t" * 256)
    assert (body["my_flag"], body["my_num"], body["my_tag"]) == (True, 1.5, "t" * 256)
    for big in ("t" * 257, ["a"], {"a": 1}):
        with pytest.raises(ProxyError) as exc:
            parse(endpoint, my_blob=big)
        assert exc.value.status == 400 and exc.value.param == "my_blob"
        assert exc.value.code == "unknown_field"


def test_real_clients_fields_pass() -> None:
    chat = {
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
        "top_logprobs": 2, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "seed": 1, "stop": ["x"],
        "logit_bias": {"1": 2}, "structured_outputs": {"choice": ["a"]},
        "guided_json": {"type": "object"}, "chat_template_kwargs": {"t": 1},
        "add_generation_prompt": True, "return_token_ids": True, "skip_special_tokens": False,
        "min_tokens": 1, "ignore_eos": True, "max_tokens": 5,
    }  # fmt: skip
    assert parse("chat", **chat).keys() >= chat.keys()
    pooled = {"encoding_format": "base64", "dimensions": 8, "truncate_prompt_tokens": 4}
    assert parse("embeddings", **pooled).keys() >= pooled.keys()


def bound(endpoint: Endpoint, body: dict[str, Any]) -> tuple[int, int]:
    raw = json.dumps({"model": "tiny", **body}).encode()
    parsed = parse_body(raw, endpoint, TIER, Limits(), Scheduling())
    return parsed.prompt_upper_bound, len(raw)


def test_a_tool_parameter_named_file_counts_its_bytes() -> None:
    # Before: 0 (subtrees under media-like keys were skipped anywhere).
    schema = {"type": "object", "properties": {"file": {"description": "x" * 80_000}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    got, size = bound("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert got >= 80_000 and got >= size


def test_empty_inputs_cost_their_special_tokens() -> None:
    # Before: 32 tokens for 100,000 empty strings.
    got, size = bound("embeddings", {"input": [""] * 100_000})
    assert got >= size + 4 * 100_000


def test_score_counts_every_pair() -> None:
    got, _ = bound("score", {"text_1": "q" * 1_000, "text_2": ["d"] * 100})
    assert got >= 100 * 1_000


@pytest.mark.parametrize("endpoint", ROUTES)
def test_the_bound_is_never_below_the_body_bytes_without_media(endpoint: Endpoint) -> None:
    got, size = bound(endpoint, {**MINIMAL[endpoint], "nulls": None, "pad": "p" * 200})
    assert got >= size
