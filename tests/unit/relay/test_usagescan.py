"""The usage of a large JSON answer found wherever it is, whatever the reads' sizes."""

from __future__ import annotations

import orjson
import pytest

from proxy.relay.usagescan import MAX_USAGE_BYTES, UsageScan

USAGE = {"prompt_tokens": 10, "completion_tokens": 1500, "total_tokens": 1510}


def scanned(body: bytes, piece: int) -> dict[str, object] | None:
    scan = UsageScan()
    for at in range(0, len(body), piece):
        scan.feed(body[at : at + piece])
    return scan.usage


@pytest.mark.parametrize("piece", [1, 3, 64, 4_096, 65_536, 10**9])
def test_the_top_level_usage_is_found_before_a_large_tail(piece: int) -> None:
    # vLLM's completions answer: top_logprobs keyed by token text ("usage" is a token too),
    # then usage (with nested details), then a client-sized tail.
    choice = {"index": 0, "text": "x", "logprobs": {"top_logprobs": [{"usage": -1.5}] * 50}}
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}}
    tail = {"kv_transfer_params": {"blob": "z" * 100_000}}
    body = orjson.dumps({"choices": [choice], "usage": usage, **tail})
    assert scanned(body, piece) == usage


def test_a_usage_right_after_a_false_key_in_the_last_chunk_is_found() -> None:
    body = b'{"choices":[{"top_logprobs":[{"usage":-1.5}]}],"usage":' + orjson.dumps(USAGE) + b"}"
    scan = UsageScan()
    scan.feed(b"z" * (2 * MAX_USAGE_BYTES))
    scan.feed(body)
    assert scan.usage == USAGE


def test_no_usage_is_none() -> None:
    assert scanned(b'{"choices":[{"text":"\\"usage\\":{\\"prompt_tokens\\":1}"}]}', 5) is None
