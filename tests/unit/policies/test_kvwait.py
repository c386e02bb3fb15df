"""The best tier's wait for KV memory (``proxy.policies.kvwait``), on an injected clock."""

from __future__ import annotations

from proxy.policies.kvterms import latency_weights
from proxy.policies.kvwait import MINORITY, WAIT_TOKENS, KvWait
from tests.helpers.clock import FakeClock

WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=0.5, worst=0.1)


def _wait(clock: FakeClock) -> KvWait:
    return KvWait(WEIGHTS, tau_s=30.0, at_least=16, clock=clock)


def test_only_the_best_tier_pays_the_wait_and_only_where_another_backend_admits_it_now() -> None:
    wait = _wait(FakeClock())
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS
    assert wait.tokens("high", fits_somewhere=False) == 0.0  # waits anywhere: nothing to trade
    assert wait.tokens("normal", fits_somewhere=True) == 0.0
    assert wait.tokens("low", fits_somewhere=True) == 0.0
    assert wait.tokens("unknown", fits_somewhere=True) == 0.0


def test_the_wait_counts_while_the_best_tier_fills_under_half_the_blocks_filled_lately() -> None:
    clock = FakeClock()
    wait = _wait(clock)
    for _ in range(10):
        wait.sent("high", 4.0)
    # Fewer than 16 sent: not judged yet, the wait counts.
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS
    for _ in range(10):
        wait.sent("low", 4.0)
    assert wait.tokens("high", fits_somewhere=True) == 0.0  # 40 of 80 blocks: not under half
    wait.sent("low", 1.0)
    assert MINORITY > 40 / 81 and wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS


def test_cached_repeats_and_tiny_prompts_of_the_best_tier_take_no_vote() -> None:
    # Red team, 2026-12-05: a best-tier tenant's trickle of one-line requests, counted one
    # each, made the tier the majority and switched the wait off for its other tenants.
    clock = FakeClock()
    wait = _wait(clock)
    for _ in range(20):
        wait.sent("low", 8.0)
        wait.sent("high", 2.0)  # another best-tier tenant's turns
    for _ in range(200):
        wait.sent("high", 0.0)  # cached, or under one block: it fills nothing
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS


def test_what_the_engine_did_not_run_is_taken_back_and_old_sends_fade() -> None:
    clock = FakeClock()
    wait = _wait(clock)
    for _ in range(12):
        wait.sent("low", 2.0)
    for _ in range(12):
        wait.sent("high", 2.0)
    assert wait.tokens("high", fits_somewhere=True) == 0.0
    for _ in range(4):
        wait.unsent("high", clock(), 2.0)  # refused, never ran: a share of nothing
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS  # 16 of 40 blocks
    clock.advance(300.0)  # ten time constants: faded below the 16 sends needed to judge
    for _ in range(12):
        wait.sent("high", 2.0)
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS
