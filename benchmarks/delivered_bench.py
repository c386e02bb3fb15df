"""What counting a stream's delivered chunks (``proxy.relay.delivered``) costs the relay: its
per-read work per SSE event, ``SseRelay.feed`` alone (before) and with ``Delivered.chunks`` on
each block written (after), on vLLM-shaped chat chunks, one event per read (a token at a time:
the common case at low load) and 16 per read (reads coalesced under load). Each timed apart,
the minimum of ``--repeat`` runs (a shared machine is noisy).

    PYTHONPATH=$PWD python benchmarks/delivered_bench.py
"""

from __future__ import annotations

import argparse
import timeit

from proxy.relay.delivered import Delivered
from proxy.relay.sserelay import SseRelay

EVENT = (
    b'data: {"id":"chatcmpl-9f1c2b7e4d5a4c3b8a1e0f2d3c4b5a69","object":"chat.completion.chunk",'
    b'"created":1796094904,"model":"Qwen/Qwen2.5-1.5B-Instruct","choices":[{"index":0,'
    b'"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}\n\n'
)


def per_event_ns(per_read: int, repeat: int, number: int) -> tuple[float, float]:
    """(ns an event in ``SseRelay.feed``, ns an event in ``Delivered.chunks``): the minimum
    over ``repeat`` timings of ``number`` reads each (the least disturbed run)."""
    block = EVENT * per_read
    relay = SseRelay(1 << 20, strip_usage=True)
    delivered = Delivered()
    delivered.chunks(block)  # past the opening chunks, as after a stream's first block
    feed = min(timeit.repeat(lambda: relay.feed(block), number=number, repeat=repeat))
    count = min(timeit.repeat(lambda: delivered.chunks(block), number=number, repeat=repeat))
    scale = 1e9 / number / per_read
    return feed * scale, count * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(f"event: {len(EVENT)} bytes")
    print("| events/read | feed ns/event | count ns/event | feed ev/s | feed+count ev/s | cost |")
    print("|---|---|---|---|---|---|")
    for per_read in (1, 16):
        feed, count = per_event_ns(per_read, args.repeat, args.number)
        before, after = 1e9 / feed, 1e9 / (feed + count)
        print(
            f"| {per_read} | {feed:.0f} | {count:.0f} | {before:,.0f} | {after:,.0f} |"
            f" {count / feed:+.1%} |"
        )


if __name__ == "__main__":
    main()
