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


def test_the_wait_counts_while_the_best_tier_is_under_half_the_requests_sent_lately() -> None:
    clock = FakeClock()
    wait = _wait(clock)
    for _ in range(10):
        wait.sent("high")
    # Fewer than 16 sent: not judged yet, the wait counts.
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS
    for _ in range(10):
        wait.sent("low")
    assert wait.tokens("high", fits_somewhere=True) == 0.0  # 10 of 20: not under half
    wait.sent("low")
    assert MINORITY > 10 / 21 and wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS


def test_what_the_engine_did_not_run_is_taken_back_and_old_sends_fade() -> None:
    clock = FakeClock()
    wait = _wait(clock)
    for _ in range(12):
        wait.sent("low")
    for _ in range(12):
        wait.sent("high")
    assert wait.tokens("high", fits_somewhere=True) == 0.0
    for _ in range(4):
        wait.unsent("high", clock())  # refused, never ran: a share of nothing
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS  # 8 of 20
    clock.advance(300.0)  # ten time constants: faded below the 16 needed to judge
    for _ in range(12):
        wait.sent("high")
    assert wait.tokens("high", fits_somewhere=True) == WAIT_TOKENS
