"""The read-at-a-time SSE relay (proxy.relay.sserelay): whatever the cuts of the reads, the bytes
forwarded are the stream's, minus a stripped usage chunk; usage, [DONE] and error events are
seen; an oversize event is refused only after the events before it."""

from __future__ import annotations

import orjson
import pytest

from proxy.relay.sse import EventTooLarge
from proxy.relay.sserelay import SseRelay, split_events

TOKENS = [b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'] * 3
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"total_tokens":4},"system_fingerprint":"fp-1"}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = b"".join([*TOKENS, FINISH, USAGE, DONE])


def relay_in_cuts(
    data: bytes, size: int, *, strip: bool, limit: int = 4096
) -> tuple[bytes, SseRelay]:
    relay = SseRelay(limit, strip_usage=strip)
    out = b"".join(relay.feed(data[at : at + size]) for at in range(0, len(data), size))
    return out + relay.finish(), relay


@pytest.mark.parametrize("strip", [False, True])
def test_every_cut_gives_the_same_bytes_and_findings(strip: bool) -> None:
    expected = STREAM
    if strip:  # the usage chunk goes, its fingerprint moves onto the terminal chunk
        stamped = FINISH.replace(b"}]}\n", b'}],"system_fingerprint":"fp-1"}\n')
        expected = b"".join([*TOKENS, stamped, DONE])
    for size in range(1, len(STREAM) + 1):
        out, relay = relay_in_cuts(STREAM, size, strip=strip)
        assert out == expected, size
        assert relay.usage == {"total_tokens": 4} and relay.saw_done and not relay.error_event


def test_a_stream_cut_short_keeps_its_last_event_and_lacks_done() -> None:
    out, relay = relay_in_cuts(b"".join(TOKENS) + b"data: cut", 5, strip=True)
    assert out == b"".join(TOKENS) + b"data: cut\n" and not relay.saw_done


def test_an_error_event_is_seen_and_passed_on() -> None:
    error = b"data: " + orjson.dumps({"error": {"message": "boom", "code": 500}}) + b"\n\n"
    out, relay = relay_in_cuts(TOKENS[0] + error + DONE, 1000, strip=True)
    assert out == TOKENS[0] + error + DONE and relay.error_event and relay.saw_done
    _, clean = relay_in_cuts(STREAM, 1000, strip=True)
    assert not clean.error_event


def test_an_oversize_event_is_refused_after_the_events_before_it() -> None:
    relay = SseRelay(100, strip_usage=False)
    assert relay.feed(TOKENS[0] + b"data: " + b"x" * 200 + b"\n\n") == TOKENS[0]
    with pytest.raises(EventTooLarge):
        relay.feed(DONE)
    with pytest.raises(EventTooLarge):  # no end in sight past the limit
        SseRelay(100, strip_usage=False).feed(b"data: " + b"y" * 200)


def test_split_events_cuts_at_blank_lines_as_the_line_reader() -> None:
    assert split_events(b"data: a\n\n: ping\r\n\r\ndata: b\ndata: c\n\n") == [
        b"data: a\n\n",
        b": ping\r\n\r\n",
        b"data: b\ndata: c\n\n",
    ]


def _choice(index: int, finish: str | None = None, text: str = "a") -> bytes:
    delta = {} if finish else {"content": text}
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def test_n_choices_pass_as_they_come_only_terminal_chunks_wait() -> None:
    """n > 1 without include_usage: once choice 0 finished, choice 1's tokens used to wait
    (in memory, unbounded) for the usage chunk at the stream's end; the client saw nothing."""
    relay = SseRelay(4096, strip_usage=True)
    assert relay.feed(_choice(0) + _choice(1)) == _choice(0) + _choice(1)
    assert relay.feed(_choice(0, "stop")) == b""  # waits for the fingerprint
    for _ in range(100):
        assert relay.feed(_choice(1)) == _choice(1)  # as it comes
    assert relay.feed(_choice(1, "length")) == b""
    end = relay.feed(USAGE + DONE) + relay.finish()
    stamp = b',"system_fingerprint":"fp-1"}\n'
    assert end == b"".join(
        [
            _choice(0, "stop").replace(b"}\n", stamp, 1),
            _choice(1, "length").replace(b"}\n", stamp, 1),
            DONE,
        ]
    )


def test_what_waits_for_the_usage_chunk_is_bounded() -> None:
    from proxy.relay.sserelay import MAX_HELD_BYTES

    relay = SseRelay(1 << 20, strip_usage=True)
    held_out = b""
    fat = _choice(0, "stop").replace(b'"delta":{}', b'"delta":{"x":"' + b"y" * 10_000 + b'"}')
    for _ in range(2 * MAX_HELD_BYTES // len(fat) + 2):
        held_out += relay.feed(fat)
    assert held_out  # past the bound the terminal chunks went on without the fingerprint
    assert relay._held_bytes <= MAX_HELD_BYTES


def _usage(completion: int) -> bytes:
    usage = {"completion_tokens": completion, "total_tokens": completion}
    return b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"


AFTER_DONE = TOKENS[0] + _usage(100_000) + DONE


@pytest.mark.parametrize("strip", [False, True])
def test_nothing_after_done_is_forwarded_or_billed_whatever_the_cuts(strip: bool) -> None:
    """A backend that writes more after [DONE] (in the same read or later): the client's stream
    ends at [DONE] and the usage chunk after it is not the one billed."""
    expected, _ = relay_in_cuts(STREAM, len(STREAM), strip=strip)
    data = STREAM + AFTER_DONE
    for size in range(1, len(data) + 1):
        out, relay = relay_in_cuts(data, size, strip=strip)
        assert out == expected, size
        assert relay.usage == {"total_tokens": 4} and relay.saw_done, size


def test_done_is_an_event_whose_whole_data_is_done() -> None:
    # Two data lines make one event whose data is '{...}\n[DONE]': not the end.
    two_lines = TOKENS[0].rstrip(b"\n") + b"\ndata: [DONE]\n\n"
    in_text = TOKENS[0].replace(b'"a"', b'"[DONE]"')  # a token whose text is [DONE]
    for event in (two_lines, in_text, b"data: [DONE] x\n\n"):
        relay = SseRelay(4096, strip_usage=False)
        assert relay.feed(event + TOKENS[1]) == event + TOKENS[1] and not relay.saw_done
        assert relay.feed(DONE) == DONE and relay.saw_done
    # The field's one optional space, a comment line, CRLF: still the [DONE] event.
    for done in (b"data:[DONE]\n\n", b": ping\ndata: [DONE]\n\n", b"data: [DONE]\r\n\r\n"):
        relay = SseRelay(4096, strip_usage=False)
        assert relay.feed(TOKENS[0] + done + TOKENS[1]) == TOKENS[0] + done and relay.saw_done


def test_held_terminal_chunks_go_out_before_done_without_a_usage_chunk() -> None:
    """vLLM's n=2 stream whose choice 1 fails after choice 0 finished: an error event, then
    [DONE], no usage chunk. The held terminal chunk came after [DONE], where SDKs stop."""
    error = b"data: " + orjson.dumps({"error": {"message": "boom", "code": 500}}) + b"\n\n"
    for cut in (1, 7, 1000):
        data = _choice(0) + _choice(1) + _choice(0, "stop") + _choice(1) + error + DONE
        out, relay = relay_in_cuts(data, cut, strip=True)
        assert out == _choice(0) + _choice(1) + _choice(1) + error + _choice(0, "stop") + DONE
        assert relay.error_event and relay.saw_done and relay.usage is None


def test_a_stream_cut_short_gives_its_held_chunks_back_first() -> None:
    relay = SseRelay(4096, strip_usage=True)
    assert relay.feed(_choice(0, "stop") + _choice(1)) == _choice(1)
    assert relay.take_held() == _choice(0, "stop") and relay.take_held() == b""
    assert relay.finish() == b""


def test_a_4xx_error_as_the_first_event_is_a_refusal_one_after_tokens_is_not() -> None:
    # vLLM validates some fields only once it streams (top_logprobs past max_logprobs, a token
    # id out of vocabulary): HTTP 200, this error, [DONE]. No engine work: the chooser must
    # not keep it as placement (test_kv_placement_served).
    refusal = b"data: " + orjson.dumps({"error": {"message": "no", "code": 400}}) + b"\n\n"
    _, refused = relay_in_cuts(refusal + DONE, 7, strip=True)
    assert refused.error_event and refused.refused
    _, later = relay_in_cuts(TOKENS[0] + refusal + DONE, 7, strip=True)
    assert later.error_event and not later.refused
    crash = b"data: " + orjson.dumps({"error": {"message": "boom", "code": 500}}) + b"\n\n"
    _, failed = relay_in_cuts(crash + DONE, 7, strip=True)
    assert failed.error_event and not failed.refused
