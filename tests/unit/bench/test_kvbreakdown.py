"""Where a conversation run's prefill went: the benchmark's accounting, on made-up records."""

from __future__ import annotations

from proxy.bench.convclient import ChatRecord
from proxy.bench.kvbreakdown import breakdown


def _turn(
    conv: str, turn: int, at: float, prompt: int, cached: int, rid: str, tenant: str = "t"
) -> ChatRecord:
    rec = ChatRecord(tenant, "normal", "turn", turn, at, 0.01, at + 0.1, 200, prompt, 8, cached)
    rec.conversation, rec.request_id = conv, rid
    return rec


def test_each_lost_token_is_counted_once_by_why() -> None:
    records = [
        _turn("t/0/0", 1, 0.0, 700, 0, "a1"),  # the tenant's first turn: floor
        _turn("t/0/0", 2, 1.0, 900, 672, "a2"),  # 672 = 700 in whole blocks: nothing lost
        _turn("t/0/0", 3, 2.0, 1100, 0, "a3"),  # moved: 896 reusable lost
        _turn("t/0/0", 4, 3.0, 1300, 544, "a4"),  # same engine, 1088 reusable: 544 evicted
        _turn("t/1/0", 1, 4.0, 720, 640, "b1"),  # a later conversation: 80 computed
        ChatRecord("f", "low", "flood", 0, 5.0, 0.01, 5.1, 200, 300, 8, 0),  # floor
        ChatRecord("f", "low", "flood", 0, 6.0, None, 6.1, 503, 300, 0, 0),  # failed: not at all
    ]
    engines = {"a1": "A", "a2": "A", "a3": "B", "a4": "B", "b1": "A"}
    out = breakdown(records, engines, 32)
    assert out.prompt == 700 + 900 + 1100 + 1300 + 720 + 300
    assert (out.moved, out.evicted, out.new_conversation) == (896, 544, 80)
    computed = 700 + 228 + 1100 + 756 + 80 + 300
    assert out.floor + out.moved + out.evicted + out.new_conversation == computed
    assert abs(sum(out.shares().values()) - computed / out.prompt) < 1e-9
