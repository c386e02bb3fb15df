"""Error bodies in the OpenAI shape, and the outcome each one is logged and counted as."""

from __future__ import annotations

import orjson
import pytest

from proxy.api import errors, input_errors
from proxy.api.errors import ProxyError
from proxy.api.outcome import Outcome, outcome_of

CASES: list[tuple[ProxyError, int, str, Outcome]] = [
    (errors.unauthorized(), 401, "invalid_api_key", Outcome.UNAUTHORIZED),
    (errors.too_large(10), 413, "request_too_large", Outcome.REJECTED),
    (errors.model_not_found("m"), 404, "model_not_found", Outcome.REJECTED),
    (errors.queue_full("low", 2.2), 429, "queue_full", Outcome.QUEUE_FULL),
    (
        errors.rate_limited("requests_per_minute", 1),
        429,
        "rate_limit_exceeded",
        Outcome.RATE_LIMITED,
    ),
    (errors.queue_timeout("low", 9.0, 3), 503, "queue_timeout", Outcome.QUEUE_TIMEOUT),
    (errors.config_changed(), 503, "config_changed", Outcome.UNAVAILABLE),
    (errors.backend_overloaded(), 503, "backend_overloaded", Outcome.UNAVAILABLE),
    (errors.no_backend("none"), 503, "backend_unavailable", Outcome.UNAVAILABLE),
    (errors.execution_timeout(5), 504, "request_timeout", Outcome.TIMEOUT),
    (errors.upstream_failed("cut"), 502, "upstream_error", Outcome.ERROR),
    (errors.unknown_url("GET", "/v1/x"), 404, "unknown_url", Outcome.REJECTED),
    (errors.admin_disabled(), 404, "admin_disabled", Outcome.REJECTED),
    (errors.unknown_backend("http://b"), 404, "unknown_backend", Outcome.REJECTED),
]


@pytest.mark.parametrize(("err", "status", "code", "outcome"), CASES)
def test_each_error_is_openai_shaped(
    err: ProxyError, status: int, code: str, outcome: Outcome
) -> None:
    resp = err.response()
    assert resp.status == status and resp.content_type == "application/json"
    assert isinstance(resp.body, bytes)
    body = orjson.loads(resp.body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]
    assert outcome_of(err) is outcome


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert errors.queue_full("low", 2.2).headers() == {"Retry-After": "3"}
    assert errors.rate_limited("tokens_per_minute", 0.01).headers() == {"Retry-After": "1"}
    assert errors.no_backend("none").headers() == {"Retry-After": "1"}


def test_answers_a_retry_cannot_fix_say_so() -> None:
    assert errors.unauthorized().headers() == {"x-should-retry": "false"}
    assert errors.bad_request("x").headers() == {"x-should-retry": "false"}
    assert errors.execution_timeout(5).headers() == {"x-should-retry": "false"}
    assert errors.too_large(10).headers() == {"x-should-retry": "false"}
    # Waiting helps these: the SDK's own rule (retry, honouring Retry-After) stays.
    assert "x-should-retry" not in errors.queue_full("low", 1).headers()
    assert "x-should-retry" not in input_errors.body_timeout(1).headers()
    assert "x-should-retry" not in errors.backends_failed("reset").headers()


def test_outcomes_are_the_metric_label_strings() -> None:
    assert str(Outcome.CLIENT_GONE) == "client_gone" and f"{Outcome.OK}" == "ok"
    assert Outcome("queue_timeout") is Outcome.QUEUE_TIMEOUT


def test_an_error_mid_stream_ends_the_stream() -> None:
    event = errors.upstream_failed("cut").sse_event()
    assert event.startswith(b"data: {") and event.endswith(b"data: [DONE]\n\n")
