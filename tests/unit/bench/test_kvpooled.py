"""kv_routing.py's rounds pooled into one verdict (proxy.bench.kvpooled), and the clients'
draws the rounds and the simulator's replicas share (convclient.client_stream)."""

from __future__ import annotations

import random

import pytest

from proxy.bench.convclient import ChatRecord, client_stream
from proxy.bench.kvbench import RunFigures, render
from proxy.bench.kvpooled import pool, render_pooled


def _run(policy: str, round_: int, computed: float, shares: list[float]) -> RunFigures:
    return RunFigures(
        policy=policy,
        round=round_,
        requests=0,
        failed=0,
        prompt_tokens=1000.0,
        prefill_computed=computed,
        hit_rate=0.0,
        output_tok_s=0.0,
        ttft_ms={},
        engine_share=shares,
        preemptions=0.0,
        index_exact=None,
    )


def _records(tier: str, ttfts_ms: list[float], status: int = 200) -> list[ChatRecord]:
    return [ChatRecord("t", tier, "turn", 1, 0.0, ms / 1000, 1.0, status) for ms in ttfts_ms]


def test_rounds_pool_tokens_first_tokens_and_the_busiest_round() -> None:
    runs = [
        _run("least_utilised", 1, 500, [0.5, 0.5]),
        _run("least_utilised", 2, 300, [0.6, 0.4]),
        _run("kv_aware", 1, 200, [0.5, 0.5]),
        _run("kv_aware", 2, 200, [0.3, 0.7]),
    ]
    records = {
        ("least_utilised", 1): _records("high", [10.0] * 99) + _records("low", [900.0]),
        ("least_utilised", 2): _records("high", [20.0] * 100 + [500.0]),
        ("kv_aware", 1): _records("high", [10.0] * 100) + _records("high", [9e9], status=503),
        ("kv_aware", 2): _records("high", [10.0] * 100),
    }
    pooled = pool(runs, records)
    lu, kv = pooled["least_utilised"], pooled["kv_aware"]
    assert (lu.rounds, lu.prompt_tokens, lu.prefill_computed) == (2, 2000, 800)
    assert lu.share == pytest.approx(0.4) and kv.share == pytest.approx(0.2)
    # The p99 over both rounds' first tokens, per tier; a failed request has none.
    assert lu.ttft_n == {"high": 200, "low": 1} and kv.ttft_n == {"high": 200}
    assert 20.0 <= lu.ttft_p99["high"] < 500.0
    assert kv.ttft_p99["high"] == pytest.approx(10.0)
    # Engines are not the same from one round to the next: the busiest round's share counts.
    assert kv.max_engine_share == pytest.approx(0.7)
    text = render_pooled(pooled)
    assert "prefill 0.50" in text and "busiest engine 70%" in text


def test_round_one_draws_as_the_benchmark_always_has_and_others_anew() -> None:
    # Replica 0 is the draw the validation against real vLLM compares (a seed it must keep).
    assert client_stream("t1", "0").random() == random.Random("t1/0").random()
    assert client_stream("t1", "0", 1).random() != client_stream("t1", "0").random()
    assert client_stream("t1", "flood", 2).random() == client_stream("t1", "flood", 2).random()


def test_a_run_printed_as_it_ends_is_against_its_round_s_baseline() -> None:
    runs = [_run("least_utilised", 1, 800.0, [1.0]), _run("kv_aware", 1, 400.0, [1.0])]
    row = render(runs, last_only=True).splitlines()
    assert len(row) == 3 and "`kv_aware`" in row[-1]
    assert "| 0.50 |" in row[-1]  # 40 % against least_utilised's 80 %, not nan


def test_a_worse_tail_says_whether_the_draw_alone_could_make_it() -> None:
    runs = [_run(p, 1, c, [0.5, 0.5]) for p, c in (("least_utilised", 500), ("kv_aware", 200))]
    quick = [float(10 + i % 50) for i in range(200)]
    for kv_tail, said in (([70.0, 72.0, 75.0], "within the draw's noise"), ([900.0] * 12, "real")):
        records = {
            ("least_utilised", 1): _records("high", [*quick, 55.0, 59.0]),
            ("kv_aware", 1): _records("high", [*quick[: 202 - len(kv_tail)], *kv_tail]),
        }
        text = render_pooled(pool(runs, records))
        assert "TTFT p99 x" in text and said in text
