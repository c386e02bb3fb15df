"""``kv_aware``'s count of the KV memory requests in flight hold on each backend
(``proxy.policies.kvfit``) and what it changes in the chooser's picks."""

from __future__ import annotations

from proxy.policies.backends import Candidate
from proxy.policies.kvaware import KvAware
from proxy.policies.kvfit import KvInFlight
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import ScrapedLoad
from tests.helpers.clock import FakeClock
from tests.unit.policies.test_kvaware import FakeBackend, _backends, _candidates, _chooser, _req

A, B = "http://a:80", "http://b:80"
BLOCK = 32


def test_requests_in_flight_hold_their_prompt_blocks_once_and_their_answers_blocks() -> None:
    fit = KvInFlight(BLOCK)
    assert fit.extra_blocks(0) == 1 and fit.extra_blocks(33) == 3  # a partial block, the answer
    fit.sent("r1", A, range(10), output_tokens=64)
    fit.sent("r2", A, [*range(5), 100, 101], output_tokens=32)  # shares 5 blocks with r1
    assert fit.held(A) == 12 + (1 + 2) + (1 + 1)
    assert fit.adds(A, [*range(10), 200], 0) == 1 + 1  # only its block not in flight there
    assert fit.held(B) == 0
    fit.sent("r1", B, range(10), output_tokens=64)  # sent again elsewhere: counted there only
    assert fit.held(A) == 7 + 2 and fit.held(B) == 13
    fit.ended("r2")
    fit.ended("r2")  # twice: once only
    assert fit.held(A) == 0
    fit.ended("r1")
    assert fit.held(B) == 0


def test_the_overflow_is_what_the_request_needs_past_the_cache_beside_what_is_in_flight() -> None:
    fit = KvInFlight(BLOCK)
    assert fit.overflow(A, range(100), 0, capacity=50) == 0.0  # alone: nothing to preempt
    fit.sent("r1", A, range(40), output_tokens=0)  # 41 blocks held
    assert fit.overflow(A, range(100, 110), 0, capacity=50) == 41 + 11 - 50
    assert fit.overflow(A, range(20), 0, capacity=50) == 0.0  # its prefix is in flight there
    assert fit.overflow(A, range(100, 110), 0, capacity=None) == 0.0  # size unknown: it fits
    assert fit.overflow(A, range(100, 108), 0, capacity=50) == 0.0  # 41 + 9: just fits
    assert fit.overflow(A, range(100, 109), 0, capacity=50) == 1.0
    # Relative to the least of any backend, and that least (0: one takes it now).
    assert fit.excess([A, B], range(100, 109), 0, {A: 50, B: 50}) == ({A: 32.0}, 0.0)
    assert fit.excess([A], range(100, 109), 0, {A: 50}) == ({}, 32.0)


def _loaded(backends: list[FakeBackend], kv_blocks: float | None) -> list[Candidate[FakeBackend]]:
    load = ScrapedLoad(waiting=0, running=0, kv_usage=0.0, at=0.0, kv_blocks=kv_blocks)
    return [Candidate(c.state, c.room, load) for c in _candidates(backends)]


def _pick_beside_a_long_turn(kv_blocks: float | None, end_it: bool = False) -> FakeBackend:
    """Backend a runs a 54-block turn, b a 5-block one (both prefilled, decoding: the same
    work ahead); the next request, 60 blocks, has its first 8 cached on a only."""
    a, b = _backends(2)
    chooser = _chooser()
    long_turn, short_turn = _req("high", range(54)), _req("high", range(200, 205))
    a.cached, b.cached = {*range(54), *range(100, 108)}, set(range(200, 205))
    for backend, req in ((a, long_turn), (b, short_turn)):
        chooser.served(backend, req)
        backend.inflight = 1
    if end_it:
        chooser.ended(a, long_turn, ran=True)  # its blocks are free again
    picked = chooser.pick(_loaded([a, b], kv_blocks), _req("high", range(100, 160)))
    assert picked is not None
    return a if picked is a else b


def test_the_chooser_sends_a_request_where_the_requests_in_flight_leave_kv_memory_for_it() -> None:
    # Past a's 64 blocks by 54 beside the long turn (b's by 5): worth more than 8 cached blocks.
    assert _pick_beside_a_long_turn(64).cfg.url == "http://b1:80"
    # Unknown cache sizes (no cache_config_info scraped): slots alone, the cached prefix wins.
    assert _pick_beside_a_long_turn(None).cfg.url == "http://b0:80"
    # A big enough cache, or the long turn over: it fits, the cached prefix wins.
    assert _pick_beside_a_long_turn(512).cfg.url == "http://b0:80"
    assert _pick_beside_a_long_turn(64, end_it=True).cfg.url == "http://b0:80"


def test_requests_without_prompt_blocks_end_in_any_order() -> None:
    # A request with no blocks (tools, an image, past the context) left an empty counter that
    # the next end there dropped: the one after raised KeyError (a 500, its slot never freed).
    fit = KvInFlight(BLOCK)
    fit.sent("with", A, range(3), output_tokens=0)
    fit.sent("none1", A, (), output_tokens=0)
    fit.sent("none2", A, (), output_tokens=0)
    fit.ended("with")
    fit.ended("none1")
    fit.ended("none2")
    assert fit.held(A) == 0 and fit.overflow(A, range(3), 0, capacity=1) == 0.0


DEFAULT_WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=0.5, worst=0.1)


def _turn_beside_anothers_answer(
    tier: str, *, spare_fits: bool = True, best_tier_before: int = 0
) -> FakeBackend:
    """Backend a holds 24 blocks of a 40-block turn's history, and decodes another tenant's
    30-block turn: the turn would overfill a's 64-block cache by 10 (vLLM admits it once that
    answer is done). Backend b runs nothing (``spare_fits``) or a turn that overfills it too.
    ``best_tier_before``: best-tier requests of 10 new blocks sent lately, elsewhere."""
    a, b, c = _backends(3)
    chooser = KvAware(block_size=BLOCK, latency_weights=DEFAULT_WEIGHTS, clock=FakeClock())
    for i in range(best_tier_before):  # 10 blocks each, filled on c
        chooser.served(c, _req("high", range(1000 + 10 * i, 1010 + 10 * i)))
    a.cached = set(range(24))
    others = _req("normal", range(500, 530))
    others.tenant = "other"
    chooser.served(a, others)
    a.inflight = 1
    if not spare_fits:
        chooser.served(b, _req("low", range(700, 760)))
        b.inflight = 1
    picked = chooser.pick(_loaded([a, b], 64), _req(tier, range(40)))
    assert picked is not None
    return a if picked is a else b


def test_a_best_tier_turn_goes_where_it_is_admitted_now_not_after_anothers_answer() -> None:
    # Issue 32, s95022: the best tier's turn waited at home for another tenant's answer to free
    # KV memory (270 ms for 30 ms of prefill saved), while other engines had it free.
    assert _turn_beside_anothers_answer("high").cfg.url == "http://b1:80"
    # The worse tiers follow their history home: the prefill saved, not the wait, is theirs.
    assert _turn_beside_anothers_answer("normal").cfg.url == "http://b0:80"
    # Nowhere admits it now: the wait is the same everywhere, the history wins.
    assert _turn_beside_anothers_answer("high", spare_fits=False).cfg.url == "http://b0:80"
    # The best tier is most of the traffic: its wait is everyone's, it stays with its history.
    assert _turn_beside_anothers_answer("high", best_tier_before=20).cfg.url == "http://b0:80"
