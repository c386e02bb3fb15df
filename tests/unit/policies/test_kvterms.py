"""``backends: kv_aware``'s scoring terms, its picker and its hold rule, each alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from proxy.config.backends import Backend
from proxy.policies.backends import Candidate
from proxy.policies.kvhold import HomeHold
from proxy.policies.kvterms import (
    OVERFLOW_WEIGHT,
    Scene,
    Scored,
    balance,
    cached_prefix,
    home_affinity,
    kv_overflow,
    leaves_home,
    no_worse_than_home,
    pick_best,
    placed_as_new,
    score,
    serves_home,
    starts_apart_on,
)
from proxy.policies.types import QueuedRequest, ScrapedLoad

A, B_URL = "http://a:80", "http://b:80"
SCENE = Scene(
    prompt=100,
    weight=1.0,
    home=None,
    home_slots=1.5,
    home_cover=1.0,
    shares={},
    over=set(),
    roomiest=0.0,
    may_move=False,
)


@dataclass(eq=False)
class View:
    cfg: Backend
    inflight: int = 0
    max_room: float = 4.0
    reinstated_at: float | None = None

    def available(self, now: float) -> bool:
        return True

    def fresh_load(self, now: float, stale_after_s: float) -> ScrapedLoad | None:
        return None

    def cached_blocks(self, blocks: Sequence[int]) -> int | None:
        return 0


def _view(url: str = A, inflight: int = 0) -> View:
    return View(Backend(url=url), inflight=inflight)


def _candidate(view: View) -> Candidate[View]:
    return Candidate(view, view.max_room - view.inflight, None)


def test_cached_prefix_is_the_share_of_the_prompt_saved_at_most_all() -> None:
    assert cached_prefix(0, 100) == 0.0
    assert cached_prefix(25, 100) == 0.25
    assert cached_prefix(300, 100) == 1.0


def test_a_prompt_is_placed_as_new_while_no_backend_holds_half_of_it() -> None:
    assert placed_as_new(0, SCENE)  # SCENE's prompt: 100 tokens
    assert placed_as_new(49, SCENE)
    assert not placed_as_new(50, SCENE)  # half: its home, or where half of it is cached
    assert not placed_as_new(100, SCENE)


def test_a_first_prompt_under_others_preamble_starts_where_no_tenant_lives_while_one_does_home() -> (
    None
):
    C = "http://c:80"
    urls = (A, B_URL, C)
    assert starts_apart_on(A, {A: 1}, urls) == {B_URL, C}  # a tenant lives on the home only
    assert starts_apart_on(A, {A: 2, B_URL: 1}, urls) == {C}
    assert starts_apart_on(A, {A: 1, B_URL: 3, C: 1}, urls) == set()  # every one lived on
    assert starts_apart_on(A, {B_URL: 1}, urls) == set()  # nobody lives on the home: it joins
    assert starts_apart_on(None, {A: 1}, urls) == set()  # no home
    # The tenants file has a cache group for each backend (or more): each gets one, so the
    # group's first tenants join their preamble; fewer, and they start apart.
    assert starts_apart_on(A, {A: 1}, urls, groups=3, backends=3) == set()
    assert starts_apart_on(A, {A: 1}, urls, groups=4, backends=3) == set()
    assert starts_apart_on(A, {A: 1}, urls, groups=2, backends=3) == {B_URL, C}


def test_an_apart_start_keeps_only_backends_with_the_homes_room_and_no_more_kv_overflow() -> None:
    C = "http://c:80"
    home, busy, idle = _candidate(_view(A, 1)), _candidate(_view(B_URL, 3)), _candidate(_view(C))
    scene = replace(SCENE, home=A)
    apart = frozenset({B_URL, C})
    assert no_worse_than_home([home, busy, idle], apart, scene) == [idle]
    assert no_worse_than_home([home, busy], apart, scene) == []  # it joins its home
    assert no_worse_than_home([busy, idle], apart, scene) == [busy, idle]  # home is full
    spilling = replace(scene, overflow={C: 500.0})  # idle, but past its KV cache
    assert no_worse_than_home([home, busy, idle], apart, spilling) == []


def test_home_affinity_is_home_slots_of_the_home_s_room_and_nothing_elsewhere() -> None:
    home = replace(SCENE, home=A)
    assert home_affinity(_view(A), home) == pytest.approx(1.5 / 4.0)
    assert home_affinity(_view(B_URL), home) == 0.0
    assert home_affinity(_view(A), SCENE) == 0.0  # no home known


def test_home_affinity_scales_with_the_share_of_the_prompt_the_home_holds() -> None:
    # A preamble shared by tenants that is a fifth of the prompt is worth a fifth of the home
    # bonus: packing every tenant under it onto one cache would evict what each holds alone.
    preamble = replace(SCENE, home=A, home_cover=0.2)
    assert home_affinity(_view(A), preamble) == pytest.approx(0.2 * 1.5 / 4.0)


def test_balance_prefers_the_backend_sent_less_lately() -> None:
    scene = replace(SCENE, shares={A: 0.7, B_URL: 0.3})
    assert balance(_view(B_URL), scene) > balance(_view(A), scene)
    assert balance(_view("http://new:80"), scene) == 0.0


def test_leaves_home_only_when_moves_are_allowed_over_share_and_busier() -> None:
    busy = _candidate(_view(A, inflight=3))
    scene = replace(SCENE, over={A}, roomiest=0.5, may_move=True)
    assert leaves_home(busy, scene)
    assert not leaves_home(busy, replace(scene, may_move=False))
    assert not leaves_home(busy, replace(scene, over=set()))
    assert not leaves_home(busy, replace(scene, roomiest=0.0))  # no backend has more room
    # Busier in slots, not in KV held: a home whose requests in flight hold more KV, at the same
    # slots, keeps its prefix (s95004: a tenant's new conversation left its 2,580-token system
    # prompt's engine because its other conversation there held more KV than a flood request).
    full_cache = ScrapedLoad(waiting=0, running=0, kv_usage=0.9, at=0.0)
    home = Candidate(_view(A), 4.0, full_cache)
    assert not leaves_home(home, replace(scene, roomiest=0.75))
    assert leaves_home(
        Candidate(_view(A, inflight=1), 3.0, full_cache), replace(scene, roomiest=0.75)
    )


def test_score_sums_cache_and_weighted_room_and_a_leaving_home_counts_no_cache() -> None:
    idle, busy = _candidate(_view(A)), _candidate(_view(B_URL, inflight=2))
    # Equal cache: the room decides; equal room: the cache decides.
    assert score(idle, 50, 0, SCENE).key > score(busy, 50, 0, SCENE).key
    assert score(busy, 90, 0, SCENE).key > score(busy, 50, 0, SCENE).key
    # A low weight of room lets a busy hot cache win; a high one sends it to the idle one.
    low, high = replace(SCENE, weight=0.25), replace(SCENE, weight=4.0)
    assert score(busy, 90, 0, low).key > score(idle, 0, 0, low).key
    assert score(idle, 0, 0, high).key > score(busy, 90, 0, high).key
    moving = replace(SCENE, over={B_URL}, roomiest=0.75, may_move=True, home=B_URL)
    assert score(busy, 90, 0, moving).key[2] == 0  # its cache no longer counts
    assert score(busy, 90, 0, moving).key == score(busy, 0, 0, moving).key


def test_kv_overflow_weighs_the_kv_memory_past_a_cache_against_the_prefill_saved() -> None:
    scene = replace(SCENE, overflow={A: 40.0})  # 40 tokens past A's cache, the prompt 100
    assert kv_overflow(_view(A), scene) == pytest.approx(OVERFLOW_WEIGHT * 0.4)
    assert kv_overflow(_view(B_URL), scene) == 0.0
    # The same cache and room: the backend it would overfill scores lower by that much.
    full, roomy = _candidate(_view(A)), _candidate(_view(B_URL))
    assert score(roomy, 50, 0, scene).key > score(full, 50, 0, scene).key
    # A cache that saves more than the overflow costs still wins.
    assert score(full, 90, 0, scene).key > score(roomy, 50, 0, scene).key
    # The best tier's wait for that memory (``kvwait``) costs its tokens where it overflows.
    waits = replace(scene, overflow_wait=40.0)
    assert kv_overflow(_view(A), waits) == pytest.approx(OVERFLOW_WEIGHT * 0.4 + 0.4)
    assert kv_overflow(_view(B_URL), waits) == 0.0
    assert score(roomy, 50, 0, waits).key > score(full, 90, 0, waits).key


def test_pick_best_takes_the_highest_key_and_the_first_of_equal_ones() -> None:
    a, b = _view(A), _view(B_URL)
    assert pick_best([]) is None
    assert pick_best([Scored(a, (1, 0, 0, 0, 0)), Scored(b, (2, 0, 0, 0, 0))]) is b
    assert pick_best([Scored(a, (1, 0, 0, 0, 5)), Scored(b, (1, 0, 0, 0, 4))]) is a
    assert pick_best([Scored(a, (1, 0, 0, 0, 0)), Scored(b, (1, 0, 0, 0, 0))]) is a


def test_a_request_waits_only_for_a_full_home_it_keeps() -> None:
    home = replace(SCENE, home=A)
    assert serves_home(home, [_view(A)])
    assert not serves_home(home, [_view(B_URL)])  # its home has room (or is down)
    assert not serves_home(SCENE, [_view(A)])  # no home
    assert not serves_home(replace(home, over={A}, may_move=True), [_view(A)])  # may leave


def _held(tier: str = "low", arrival: float = 0.0, deadline: float = 0.0) -> QueuedRequest:
    return QueuedRequest(tier, "t", 10, 10, arrival, deadline_s=deadline)


def test_the_hold_rule_waits_while_the_gain_is_enough_its_hold_runs_and_home_has_slots() -> None:
    hold = HomeHold({"low": 2.0, "high": 0.0}, hold_share=0.25)
    assert not hold.waits(_held("high"), A, 1.0, 0.5, slots=4)  # no hold for its tier
    assert not hold.waits(_held(), A, 0.1, 0.5, slots=4)  # too little to gain
    first = _held()
    assert hold.waits(first, A, 0.5, 0.5, slots=1)
    assert hold.waiting(A, 0.5) == 1 and hold.next_end(0.5) == pytest.approx(1.5)
    assert not hold.waits(_held(), A, 0.5, 0.5, slots=1)  # home's one slot has a waiter
    assert hold.waits(first, A, 0.5, 1.0, slots=1)  # the one waiting waits on
    assert not hold.waits(first, A, 0.5, 2.0, slots=1)  # its hold is over
    # Never past half its queue timeout.
    assert not hold.waits(_held(deadline=1.0), B_URL, 0.5, 0.6, slots=4)
    hold.drop(first)
    assert hold.waiting(A, 0.5) == 0 and hold.next_end(0.5) is None


def test_holds_over_expire() -> None:
    hold = HomeHold({"low": 2.0}, hold_share=0.25)
    assert hold.waits(_held(), A, 0.5, 0.5, slots=4)
    hold.expire(2.0)
    assert hold.waiting(A, 0.0) == 0


def test_the_spread_rule_leaves_a_crowded_home_only_for_prompts_it_holds_little_of() -> None:
    crowded = replace(SCENE, crowded=frozenset({A}), home=A)
    assert crowded.spreads(A) is False  # its home holds the whole prompt: it stays
    assert not crowded.spreads(B_URL)  # not crowded
    assert replace(crowded, home_cover=0.25).spreads(A)  # a short shared preamble: it goes
    assert replace(crowded, home=B_URL).spreads(A)  # not its home: counts nothing cached
    assert crowded.home_stays()
    assert replace(crowded, home_cover=0.25).home_stays() is False


def test_the_spread_rule_moves_a_new_branch_off_a_home_its_own_tenant_crowds() -> None:
    branch = replace(SCENE, crowded=frozenset({A}), home=A, branch=True)
    assert branch.spreads(A) is False  # crowded by others' traffic: it keeps its system prompt
    assert replace(branch, own_crowded=frozenset({A})).spreads(A)  # its own crowd: it goes
    own = replace(branch, own_crowded=frozenset({A}), branch=False)
    assert own.spreads(A) is False  # a conversation under way stays with its history
