"""``kv_aware``'s cost model: the work queued ahead on each backend (``proxy.policies.kvwork``),
its term (``kvterms.queue_cost``) and what it changes in the chooser's picks and holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.config.backends import Backend
from proxy.policies.kvaware import KvAware
from proxy.policies.kvterms import Scene, queue_cost
from proxy.policies.kvwork import WorkAhead
from proxy.policies.types import QueuedRequest
from tests.helpers.clock import FakeClock
from tests.unit.policies.test_kvaware import (
    BLOCK,
    WEIGHTS,
    FakeBackend,
    _arriving,
    _backends,
    _candidates,
    _full,
    _pick,
    _req,
)

A, B = "http://a:80", "http://b:80"


def _request(output: int = 100) -> QueuedRequest:
    return QueuedRequest("high", "t", prompt_tokens=1000, expected_output=output, arrival_s=0.0)


def test_work_ahead_counts_prefill_and_a_decode_share_until_the_request_ends() -> None:
    work = WorkAhead(BLOCK, decode_tokens=5.0)
    a, b = _view(A), _view(B)
    a.cached = None  # no index: nothing shows a prefill done
    b.cached = None
    first, second = _request(100), _request(10)
    work.sent(first, A, 800)  # 200 of its 1,000 tokens were cached there
    work.sent(second, B, 1000)
    assert work.of(a) == 800 + 5 and work.of(b) == 1000 + 5  # max_tokens does not count
    work.sent(first, B, 1000)  # retried elsewhere: counted once, where it went last
    assert work.of(a) == 0.0 and work.of(b) == 2 * 1005
    work.ended(first)
    work.ended(first)  # twice: once only
    assert work.of(b) == 1005
    work.ended(second)
    assert work.of(b) == 0.0 and work.of(_view("http://never:80")) == 0.0


def test_a_prefill_leaves_the_work_ahead_as_the_index_shows_its_blocks_stored() -> None:
    work = WorkAhead(BLOCK, decode_tokens=5.0)
    a = _view(A)
    blocks = tuple(range(40))  # 1,280 tokens in full blocks, 8 of them cached at dispatch
    a.cached = set(blocks[:8])
    req = _request(500)
    work.sent(req, A, 1290 - 8 * BLOCK, blocks, cached_blocks=8)
    assert work.of(a) == 1034 + 5
    a.cached |= set(blocks[8:20])  # the engine stored 12 more blocks: a chunk prefilled
    assert work.of(a) == 1034 - 12 * BLOCK + 5
    a.cached |= set(blocks[20:])  # every full block stored: it decodes, however long
    assert work.of(a) == 5.0
    a.cached = set()  # evicted later (it no longer holds them): still decoding, not prefill
    assert work.of(a) == 5.0
    work.ended(req)
    assert work.of(a) == 0.0


def _view(url: str) -> FakeBackend:
    return FakeBackend(Backend(url=url))


SCENE = Scene(
    prompt=500,
    weight=1.0,
    home=None,
    home_slots=1.5,
    home_cover=1.0,
    shares={},
    over=set(),
    roomiest=0.0,
    may_move=False,
    work_weight=1.0,
    work={A: 1500.0, B: 500.0},
    least_work=500.0,
)


def test_queue_cost_is_the_work_past_the_least_queued_over_the_prompt_weighed_by_tier() -> None:
    assert queue_cost(_view(A), SCENE) == pytest.approx(1000 / 500)
    assert queue_cost(_view(B), SCENE) == 0.0
    assert queue_cost(_view("http://c:80"), SCENE) == 0.0  # nothing sent there
    assert queue_cost(_view(A), replace(SCENE, work_weight=0.25)) == pytest.approx(0.5)
    assert queue_cost(_view(A), replace(SCENE, work_weight=0.0)) == 0.0


def _chooser(clock: FakeClock, work_weight: float, hold_s: float = 0.0) -> KvAware:
    return KvAware(
        block_size=BLOCK,
        latency_weights=WEIGHTS,
        hold_s=hold_s,
        work_weight=work_weight,
        clock=clock,
    )


def _load(chooser: KvAware, backend: FakeBackend, tokens: int) -> QueuedRequest:
    """One request of ``tokens`` uncached prompt sent to ``backend`` (running there: one slot
    of its eight taken)."""
    req = _req("low", [10_000 + j for j in range(tokens // BLOCK)])
    chooser.served(backend, req)
    backend.inflight += 1
    return req


@pytest.mark.parametrize("work_weight", [0.0, 1.0])
def test_a_best_tier_turn_leaves_a_home_with_more_work_queued_than_its_cache_saves(
    work_weight: float,
) -> None:
    clock = FakeClock()
    home, idle = backends = _backends()
    chooser = _chooser(clock, work_weight)
    turn = list(range(8))  # 266 tokens, 256 of them cached at home
    home.cached = set(turn)
    running = _load(chooser, home, 6144)  # 6,144 tokens to prefill ahead of it there
    req = _req("high", turn)
    expected = idle if work_weight else home
    assert chooser.pick(_candidates(backends), req) is expected
    # The work ended: the home's cache wins again.
    chooser.ended(home, running, ran=True)
    home.inflight -= 1
    assert chooser.pick(_candidates(backends), req) is home
    # A worst-tier turn weighs queued work by its room weight (1/16 of the best's): it
    # follows its cache behind 2,048 tokens queued (128 weighed, against 256 saved).
    _load(chooser, home, 2048)
    assert chooser.pick(_candidates(backends), _req("low", turn)) is home


def test_a_request_does_not_wait_for_a_full_home_whose_queue_costs_more_than_it_saves() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    turn = list(range(40))
    home.cached = set(turn[:30])
    held = _chooser(clock, work_weight=0.0, hold_s=1.0)
    costed = _chooser(clock, work_weight=1.0, hold_s=1.0)
    for chooser in (held, costed):
        chooser.served(home, _req("low", turn[:30]))
    _full(home)
    _load(costed, home, 12_288)  # far more queued at home than the 960 tokens it would save
    home.inflight = int(home.max_room)
    assert _pick(held, backends, _arriving("low", turn, clock), clock) is None  # waits
    # The worst tier weighs queued work at 1/16: 12,288 tokens / 16 = 768 < 960 saved: waits.
    assert _pick(costed, backends, _arriving("low", turn, clock), clock) is None
    assert _pick(costed, backends, _arriving("high", turn, clock), clock) is spare


def test_a_turn_returns_home_once_the_prefill_ahead_is_stored_though_it_still_decodes() -> None:
    clock = FakeClock()
    home, idle = backends = _backends()
    chooser = _chooser(clock, work_weight=1.0)
    turn = list(range(8))
    home.cached = set(turn)
    running = _load(chooser, home, 6144)
    req = _req("high", turn)
    assert chooser.pick(_candidates(backends), req) is idle  # 6,144 tokens ahead at home
    assert running.prompt_blocks is not None
    home.cached |= set(running.prompt_blocks)  # its prefill done: the engine stored its blocks
    assert chooser.pick(_candidates(backends), req) is home  # it decodes: its cache wins again
