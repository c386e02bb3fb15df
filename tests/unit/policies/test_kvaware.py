"""``backends: kv_aware`` alone, over fake backends whose cache index the test sets, and the
balanced first placement of ``prefix_affinity``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from proxy.backends.pool import BackendPool
from proxy.bench.kvviews import IndexedBackend
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import Candidate, LeastUtilised, PrefixAffinity
from proxy.policies.kvaware import KvAware
from proxy.policies.kvrecent import DecayingCounts
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import QueuedRequest
from tests.helpers.clock import FakeClock

HEALTH = BackendHealth()
BLOCK = 32
WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=4.0, worst=0.25)


FakeBackend = IndexedBackend


def _backends(n: int = 2) -> list[FakeBackend]:
    return [FakeBackend(Backend(url=f"http://b{i}:80")) for i in range(n)]


def _candidates(backends: list[FakeBackend]) -> list[Candidate[FakeBackend]]:
    out = []
    for b in backends:
        room = b.max_room - b.inflight
        if room >= 1:
            out.append(Candidate(b, room, None))
    return out


def _req(tier: str, blocks: Sequence[int] | None, prompt: int | None = None) -> QueuedRequest:
    size = prompt if prompt is not None else BLOCK * len(blocks or ()) + 10
    req = QueuedRequest(tier, "t", prompt_tokens=size, expected_output=16, arrival_s=0.0)
    req.prompt_blocks = tuple(blocks) if blocks is not None else None
    return req


def _chooser(clock: FakeClock | None = None) -> KvAware:
    return KvAware(block_size=BLOCK, latency_weights=WEIGHTS, clock=clock or FakeClock())


def _place(chooser: KvAware, backends: list[FakeBackend], req: QueuedRequest) -> FakeBackend:
    picked = chooser.pick(_candidates(backends), req)
    assert picked is not None
    chooser.served(picked, req)
    chooser.ended(picked, req, ran=True)  # it ran: kept
    return picked


def test_the_backend_that_holds_the_longest_prefix_wins_at_equal_load() -> None:
    a, b = backends = _backends()
    a.cached = {1, 2}
    b.cached = {1, 2, 3, 4, 5}
    assert _chooser().pick(_candidates(backends), _req("normal", [1, 2, 3, 4, 5, 6])) is b
    # The index counts leading blocks only: b's run stops at block 1 for this prompt.
    assert _chooser().pick(_candidates(backends), _req("normal", [1, 2, 9, 4, 5])) is a


def test_a_high_tier_request_takes_an_idle_backend_over_a_busy_hot_cache_a_low_tier_one_waits() -> (
    None
):
    hot, idle = backends = _backends()
    hot.cached = set(range(20))
    hot.inflight = 6  # of 8
    blocks = list(range(20))
    assert _chooser().pick(_candidates(backends), _req("high", blocks)) is idle
    assert _chooser().pick(_candidates(backends), _req("low", blocks)) is hot
    # At equal load every tier follows its cache.
    idle.inflight = 6
    assert _chooser().pick(_candidates(backends), _req("high", blocks)) is hot


def test_cold_indexes_and_ties_spread_the_work_never_by_config_order() -> None:
    backends = _backends(3)
    for b in backends:
        b.cached = None  # no index yet
    chooser = _chooser()
    picks = []
    for i in range(6):
        picked = _place(chooser, backends, _req("normal", [100 + i]))
        picks.append(picked)
        # Each finishes before the next arrives: every backend idle at each pick.
    assert [backends.index(p) for p in picks] == [0, 1, 2, 0, 1, 2]
    # Load breaks a tie first, then what is cached.
    backends[0].inflight = 1
    assert chooser.pick(_candidates(backends), _req("normal", None)) is not backends[0]
    backends[0].inflight = 0
    backends[2].cached = {7}
    backends[1].cached = set()
    req = _req("normal", [7], prompt=10**9)  # at equal load, what is cached decides, however little
    assert chooser.pick(_candidates(backends), req) is backends[2]


def test_a_prompt_just_sent_counts_as_cached_there_until_its_events_could_have_arrived() -> None:
    clock = FakeClock()
    backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, pending_s=5.0, clock=clock)
    system = [11, 12, 13, 14, 15, 16, 17, 18]  # 8 of the next prompt's 10 blocks
    sent = _req("normal", system)
    first = chooser.pick(_candidates(backends), sent)
    assert first is not None
    chooser.served(first, sent)  # in flight: its KV events not in yet
    first.inflight += 1  # the pool counts it in
    other = backends[1 - backends.index(first)]
    # Busier now, and its index does not show the prompt yet: it still follows the prompt.
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 19])) is first
    assert chooser.cached_tokens(first, [*system, 19]) == 8 * BLOCK
    assert chooser.cached_tokens(other, system) == 0
    chooser.ended(first, sent, ran=True)  # it ran: the index heard its events (and shows
    # nothing: evicted since), so the index is the truth again. Its home's bonus (1.5 slots,
    # times the 8 of 10 blocks it was sent: 1.2) keeps it there at one more in flight; at three
    # more the least busy wins.
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 19])) is first
    first.inflight += 2
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 19])) is other


def test_a_prompt_that_ran_counts_as_cached_only_where_the_index_is_cold() -> None:
    """Once a request ran and ended, a warm index has heard its blocks stored and any eviction
    since: the memory's word no longer counts. A cold index hears nothing: the memory's does."""
    clock = FakeClock()
    warm, cold = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, pending_s=5.0, clock=clock)
    prompt = [21, 22, 23, 24]
    for backend in (warm, cold):
        req = _req("normal", prompt)
        chooser.served(backend, req)
        assert chooser.cached_tokens(backend, prompt) == 4 * BLOCK  # in flight: counted
        chooser.ended(backend, req, ran=True)
    warm.cached = {21, 22}  # stored, then its last two blocks evicted
    cold.cached = None
    clock.advance(1.0)
    assert chooser.cached_tokens(warm, prompt) == 2 * BLOCK
    assert chooser.cached_tokens(cold, prompt) == 4 * BLOCK
    clock.advance(4.1)  # past pending_s: the cold index's backend holds nothing known
    assert chooser.cached_tokens(cold, prompt) == 0
    # Its home is still where it was sent (the memory keeps that whatever the index says).
    assert chooser.memory.home(prompt) == (cold.cfg.url, 4)


def test_latency_weights_step_geometrically_from_the_best_tier_to_the_worst() -> None:
    assert WEIGHTS == {"high": 4.0, "normal": 1.0, "low": 0.25}
    assert latency_weights({"only": 3}, best=4.0, worst=0.25) == {"only": 4.0}


def test_prefix_affinity_spreads_new_prefixes_that_arrive_while_every_backend_is_idle() -> None:
    backends = _backends()
    chooser = PrefixAffinity(capacity=100)
    picks = []
    for prefix in range(6):
        req = QueuedRequest("normal", "t", 10, 10, 0.0, prefix_hash=prefix)
        picked = chooser.pick(_candidates(backends), req)
        assert picked is not None
        chooser.served(picked, req)
        picks.append(backends.index(picked))
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]
    # Each prefix still follows its backend.
    for prefix, where in enumerate(picks):
        req = QueuedRequest("normal", "t", 10, 10, 0.0, prefix_hash=prefix)
        assert chooser.pick(_candidates(backends), req) is backends[where]


def test_a_tenants_new_conversations_gather_where_its_system_prompt_was_last_sent() -> None:
    a, b = backends = _backends()
    system = [21, 22, 23, 24, 25, 26, 27, 28]  # 8 of each prompt's 10 blocks
    a.cached = b.cached = set(system)  # both hold it: the index alone cannot choose
    chooser = _chooser()
    first = _place(chooser, backends, _req("normal", [*system, 30]))
    # Equal load, equal cached prefix: not the round-robin's turn, the system prompt's place.
    for tail in (31, 32, 33):
        assert _place(chooser, backends, _req("normal", [*system, tail])) is first
    # One request more in flight there does not scatter them (the home counts 1.5 slots
    # more times the share of the prompt it holds, 8 of 10 blocks: 1.2); two more do: load
    # still breaks the tie past that.
    first.inflight = 1
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 34])) is first
    first.inflight = 2
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 34])) is not first


def _full(backend: FakeBackend) -> None:
    backend.inflight = int(backend.max_room)  # no slot: not a candidate


def _pick(
    chooser: KvAware, backends: list[FakeBackend], req: QueuedRequest, clock: FakeClock
) -> FakeBackend | None:
    """As the pool asks: candidates, and the backends that are up but full."""
    full = [b for b in backends if b.max_room - b.inflight < 1]
    return chooser.pick(_candidates(backends), req, now=clock(), full=full)


def _arriving(
    tier: str, blocks: Sequence[int], clock: FakeClock, timeout: float = 30.0
) -> QueuedRequest:
    req = _req(tier, blocks)
    req.arrival_s, req.deadline_s = clock(), clock() + timeout
    return req


def test_a_request_whose_home_is_full_waits_for_it_up_to_its_tiers_hold() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock)
    # low is the worst tier: the whole hold; high (16x the room weight) 1/16 of it.
    assert chooser.holds == {"high": 1.0 / 16, "normal": 0.25, "low": 1.0}
    turn = list(range(40))
    assert _place(chooser, backends, _req("low", turn[:30])) is home
    _full(home)
    later = _arriving("low", turn, clock)
    assert _pick(chooser, backends, later, clock) is None  # held: 30 of 41 blocks there
    assert chooser.next_hold_end(clock()) == 1.0
    clock.advance(0.9)
    assert _pick(chooser, backends, later, clock) is None
    clock.advance(0.2)  # its hold is over: the backend with room takes it
    assert _pick(chooser, backends, later, clock) is spare
    chooser.served(spare, later)
    assert chooser.next_hold_end(clock()) is None
    # A better tier holds for less.
    other = list(range(100, 140))
    chooser.served(home, _req("high", other[:30]))
    high = _arriving("high", other, clock)
    assert _pick(chooser, backends, high, clock) is None
    clock.advance(1.0 / 16 + 0.01)
    assert _pick(chooser, backends, high, clock) is spare


def test_a_hold_runs_from_arrival_so_a_tenants_queue_waits_once_not_once_per_request() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock)
    system = list(range(30))
    _place(chooser, backends, _req("low", system))
    _full(home)
    first, second = (_arriving("low", [*system, 100 + i], clock) for i in range(2))
    assert _pick(chooser, backends, first, clock) is None
    clock.advance(1.01)  # the first's hold is over; the second, queued behind it, waited too
    assert _pick(chooser, backends, first, clock) is spare
    assert _pick(chooser, backends, second, clock) is spare


def test_a_hold_never_runs_past_half_the_queue_timeout_nor_for_a_home_that_is_down() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=10.0, clock=clock)
    system = list(range(30))
    _place(chooser, backends, _req("low", system))
    _full(home)
    req = _arriving("low", [*system, 100], clock, timeout=1.0)
    assert _pick(chooser, backends, req, clock) is None
    clock.advance(0.51)  # half of its 1 s queue timeout: it goes, long before a 503
    assert _pick(chooser, backends, req, clock) is spare
    # Home drained or ejected: not among the full backends that are up, so nothing waits.
    drained = _arriving("low", [*system, 101], clock)
    assert chooser.pick(_candidates(backends), drained, now=clock(), full=[]) is spare


def test_no_hold_when_the_home_would_save_little_or_the_hold_is_off() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock)
    _place(chooser, backends, _req("low", [1, 2]))
    _full(home)
    # 2 of 41 blocks at home: under hold_share (a quarter of the prompt); it moves at once.
    req = _arriving("low", [1, 2, *range(10, 49)], clock)
    assert _pick(chooser, backends, req, clock) is spare
    # Its prefix cached on the spare backend too: nothing to gain by waiting.
    spare.cached = set(range(30))
    assert _pick(chooser, backends, _arriving("low", list(range(40)), clock), clock) is spare
    off = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=0.0, clock=clock)
    home.inflight = 0
    spare.cached = set()
    _place(off, backends, _req("low", list(range(30))))
    _full(home)
    assert _pick(off, backends, _arriving("low", list(range(40)), clock), clock) is spare
    assert off.next_hold_end(clock()) is None


def test_the_pool_notes_what_the_index_predicted_where_it_dispatched() -> None:
    pool = BackendPool([Backend(url="http://a:1", max_inflight=4)], HEALTH, _chooser())
    (state,) = pool.all()
    req = _req("normal", [1, 2, 3])
    pool.acquire(state, 10, request=req)
    assert req.predicted_blocks is None  # no index: no prediction
    state.cached_blocks = lambda blocks: 2  # type: ignore[method-assign]
    pool.acquire(state, 10, request=req)
    assert req.predicted_blocks == 2
    without = _req("normal", None)
    pool.acquire(state, 10, request=without)
    assert without.predicted_blocks is None


def test_new_conversations_leave_a_backend_that_took_more_than_its_share_continuing_ones_stay() -> (
    None
):
    clock = FakeClock()
    hot, cool = backends = _backends()
    # The balance rule alone (the spread rule, max_share, has a test of its own).
    chooser = KvAware(
        block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock, max_share=1.0
    )
    system = [1, 2, 3, 4, 5, 6]
    # The tenant's first conversations all went to ``hot``: the system prompt branches there.
    for conv in range(20):
        assert _place(chooser, [hot], _req("normal", [*system, 100 + conv])) is hot
    hot.cached = set(system)
    hot.inflight = 3  # busier now than cool, and it took 100 % of the last 20 requests
    new = _req("normal", [*system, 200])
    assert chooser.pick(_candidates(backends), new) is cool
    # A conversation that goes on (its own turn is the deepest sent: no branch) stays home.
    hot.cached |= {100}
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 100, 101])) is hot
    # At equal load the home keeps its new conversations: the share alone moves nothing.
    hot.inflight = 0
    assert chooser.pick(_candidates(backends), new) is hot
    # Shares fade (30 s): after a quiet minute the busier home keeps them again.
    hot.inflight = 3
    clock.advance(120)
    assert chooser.pick(_candidates(backends), new) is hot


def test_no_more_requests_wait_for_a_home_than_it_has_slots() -> None:
    clock = FakeClock()
    home, spare = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock)
    system = list(range(30))
    _place(chooser, backends, _req("low", system))
    home.room_cap = 2.0
    _pick(chooser, backends, _req("low", system), clock)  # notes home's room: 2 slots
    _full(home)
    burst = [_arriving("low", [*system, 100 + i], clock) for i in range(5)]
    picks = [_pick(chooser, backends, r, clock) for r in burst]
    # Two wait for the two slots that will free at home; the rest start where there is room.
    assert picks == [None, None, spare, spare, spare]
    assert _pick(chooser, backends, burst[0], clock) is None  # a held one stays held
    # One whose client leaves (or that times out, or is displaced) waits no more: its place
    # goes to the next (fresh eyes, served hold tests: it counted until its hold's end).
    chooser.left(burst[0])
    assert _pick(chooser, backends, burst[2], clock) is None


def test_a_tenants_new_conversations_go_to_its_prefixs_home_not_where_a_turn_ran_last() -> None:
    a, b = backends = _backends()
    chooser = _chooser()
    system = [1, 2, 3]
    assert _place(chooser, [a], _req("normal", [*system, 10])) is a
    assert _place(chooser, [a], _req("normal", [*system, 20])) is a  # a branch point, home a
    assert _place(chooser, [b], _req("normal", [*system, 30])) is b  # a full: one went to b
    _place(chooser, [b], _req("normal", [*system, 30, 31]))  # its next turn ran last, on b
    a.cached = b.cached = set(system)
    # Equal load: the new conversation goes home, not where the tenant's last turn ran.
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 40])) is a
    # A turn that goes on stays with its own history.
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 30, 31, 32])) is b


def test_the_balance_rule_moves_one_prefixs_home_at_a_time() -> None:
    clock = FakeClock()
    hot, cool = backends = _backends()
    # The balance rule alone (the spread rule, max_share, has a test of its own).
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, clock=clock, max_share=1.0)
    tenants = [[100 * t + 1, 100 * t + 2] for t in range(2)]
    for conv in range(10):  # both tenants' conversations all went to hot
        for system in tenants:
            _place(chooser, [hot], _req("normal", [*system, 1000 + conv]))
    hot.cached = {b for s in tenants for b in s}
    hot.inflight = 3
    first = _place(chooser, backends, _req("normal", [*tenants[0], 2000]))
    assert first is cool  # hot took 100 % lately and is busier: the new branch moves...
    cool.cached = set(tenants[0])  # (it ran there: its index heard the blocks stored)
    # ... and the first tenant's home with it; the second tenant's home stays for now.
    assert chooser.pick(_candidates(backends), _req("normal", [*tenants[1], 2001])) is hot
    cool.inflight = 3  # equally busy: the moved home keeps its new branches
    assert chooser.pick(_candidates(backends), _req("normal", [*tenants[0], 2002])) is cool
    cool.inflight = 0
    clock.advance(31)  # one balance_s later another may move (hot's share still high)
    for conv in range(20):
        _place(chooser, [hot], _req("normal", [*tenants[1], 3000 + conv]))
    assert chooser.pick(_candidates(backends), _req("normal", [*tenants[1], 2003])) is cool


def test_a_best_tier_reserve_slot_comes_after_every_backend_with_room_of_its_own() -> None:
    # One-slot backends: a free slot and a reserve slot both leave 0 of the room after the
    # request; the reserve (past a full room, on a backend that may be stuck) must lose.
    hung, idle = _backends()
    hung.room_cap = idle.room_cap = 1.0
    hung.inflight = 1
    candidates = [Candidate(hung, 1.0, None), Candidate(idle, 1.0, None)]
    for chooser in (LeastUtilised(), PrefixAffinity(capacity=10), _chooser()):
        for _ in range(3):  # never by rotation
            req = _req("high", [1, 2])
            picked = chooser.pick(candidates, req)
            assert picked is idle, type(chooser).__name__
            chooser.served(idle, req)


def test_recent_shares_weigh_each_request_by_its_prompt_blocks_and_fade() -> None:
    clock = FakeClock()
    counts = DecayingCounts(30.0, clock)
    for _ in range(4):
        counts.add("long", 40.0)  # four turns of long conversations...
    for _ in range(10):
        counts.add("short", 8.0)  # ... fill more cache than ten short prompts
    assert counts.shares(at_least=16) == {}  # 14 requests: too few to judge
    counts.add("short", 8.0)
    counts.add("short", 8.0)
    shares = counts.shares(at_least=16)
    assert shares["long"] == 160 / 256 and shares["short"] == 96 / 256
    clock.advance(30.0)  # one time constant: the same shares, from e^-1 of the requests
    assert counts.shares(at_least=16) == {}
    assert counts.shares()["long"] == pytest.approx(160 / 256)


def test_a_backend_past_its_share_of_the_requests_lately_is_left_by_new_conversations() -> None:
    # Spread: one backend never serves most of the work while another has room (issue 32:
    # a few tenants under one shared preamble all went to one of seven engines, 69 %). A
    # conversation under way (its home holds half its prompt or more) stays with its history:
    # moved, it computes it all again and leaves three on a cache too small (s32001).
    clock = FakeClock()
    hot, cool = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=1.0, clock=clock)
    preamble = [1, 2]
    history = [[*preamble, *(100 * conv + i for i in range(4))] for conv in range(1, 21)]
    for conv in history:
        assert _place(chooser, [hot], _req("normal", conv)) is hot
    hot.cached = {*preamble, *history[0]}
    # A new conversation under the preamble (2 of its 7 blocks there) is placed as new: the
    # other backend (the spread rule would send it there too).
    new = _req("normal", [*preamble, 9000, 9001, 9002, 9003, 9004])
    assert chooser.pick(_candidates(backends), new) is cool
    # The first conversation's next turn (6 of 7 blocks there): home, past its share or not.
    turn = _req("normal", [*history[0], 105])
    assert chooser.pick(_candidates(backends), turn) is hot
    # Alone, it is still taken.
    assert chooser.pick(_candidates([hot]), new) is hot


def _crowded_home_then_new_conversation(
    victims: int, others: int, elsewhere: int = 0
) -> FakeBackend:
    """A victim's system prompt lives on ``home``, where its ``victims`` conversations and
    another tenant's ``others`` requests (one prompt repeated, cached: it fills nothing) went
    lately; a third tenant's ``elsewhere`` conversations went to the other backend; both are
    idle. Where does the victim's next new conversation go (its system prompt is three quarters
    of its first prompt)?"""
    home, other = backends = _backends()
    chooser = _chooser()
    system = [1, 2, 3, 4, 5, 6]
    for tenant, on, n in (("victim", home, victims), ("third", other, elsewhere)):
        for conv in range(n):
            own_system = system if tenant == "victim" else [7, 8, 9, 10, 11, 12]
            req = _req("normal", [*own_system, 100 + conv])
            req.tenant = tenant
            assert _place(chooser, [on], req) is on
    home.cached = set(system)
    mine = [900, 901, 902, 903, 904, 905, 906, 907]
    home.cached |= set(mine)
    for _ in range(others):
        req = _req("low", mine)
        req.tenant = "other"
        chooser.served(home, req)
        chooser.ended(home, req, ran=True)
    new = _req("normal", [*system, 300])
    new.tenant = "victim"
    picked = chooser.pick(_candidates(backends), new)
    assert picked is not None
    return picked


def test_a_tenant_that_crowds_its_home_starts_new_conversations_elsewhere() -> None:
    # Spread, issue 32 s98003: three tenants under long system prompts lived on one of two
    # engines (66 % of the requests), each new conversation kept by its system prompt. A new
    # conversation loses that prefix once, not a history: it leaves a home its tenant's own
    # work crowds (past 64 % of the prompt blocks filled lately, its own covering the excess).
    assert _crowded_home_then_new_conversation(victims=20, others=0).cfg.url == "http://b1:80"
    # Another tenant's cached repeats fill nothing: they neither crowd the home for the victim
    # (three conversations: too little work to judge, it stays with its system prompt; the
    # served test in tests/integration/test_kv_placement_served.py) ...
    assert _crowded_home_then_new_conversation(victims=3, others=40).cfg.url == "http://b0:80"
    # ... nor pin a victim whose own work crowds it there ...
    assert _crowded_home_then_new_conversation(victims=20, others=40).cfg.url == "http://b1:80"
    # ... nor move a victim whose work is balanced with a third tenant's on the other backend,
    # however many requests they add to its home (red team, 2026-12-04: by requests, they did).
    balanced = _crowded_home_then_new_conversation(victims=10, others=40, elsewhere=10)
    assert balanced.cfg.url == "http://b0:80"


def test_a_prompt_no_backend_holds_half_of_is_placed_by_room_not_by_its_short_shared_prefix() -> (
    None
):
    # Issue 32, s94040: four tenants under one short preamble, each with its own long system
    # prompt, all followed the preamble onto one engine (a few hundred tokens saved once) and
    # overfilled its cache for the whole run while others idled.
    busy, idle = backends = _backends()
    chooser = _chooser()
    preamble = [1, 2]
    first = [*preamble, 10, 11, 12, 13, 14, 15]  # tenant A: the preamble, its system prompt
    assert _place(chooser, [busy], _req("low", first)) is busy
    busy.inflight = 1
    # Tenant B under the same preamble (2 of its 9 blocks sent there): placed as new, on the
    # idle backend, even for the worst tier, which follows any larger share onto a busier one.
    assert (
        chooser.pick(_candidates(backends), _req("low", [*preamble, 20, 21, 22, 23, 24, 25]))
        is idle
    )
    # A's next conversation (8 of its 10 blocks sent there): its home.
    assert chooser.pick(_candidates(backends), _req("low", [*first, 30])) is busy
    # What the index shows counts as what was sent: half the prompt cached on the busy backend.
    busy.cached = {*preamble, 40, 41}
    assert chooser.pick(_candidates(backends), _req("low", [*preamble, 40, 41, 42, 43])) is busy


def _refused_flood_then_new_conversation(ran: bool, repeat_cached: bool = False) -> FakeBackend:
    """A victim's system prompt lives on ``home``; another tenant's 40 requests go there and
    end (``ran``: the engine ran them; else it refused them, a 400); the home is busier now.
    Where does the victim's next new conversation go?"""
    clock = FakeClock()
    home, other = backends = _backends()
    chooser = KvAware(
        block_size=BLOCK, latency_weights=WEIGHTS, clock=clock, max_share=1.0, balance_min=4
    )
    system = [1, 2, 3, 4, 5, 6]
    for conv in range(3):
        assert _place(chooser, [home], _req("normal", [*system, 100 + conv])) is home
    for conv in range(3):
        _place(chooser, [other], _req("normal", [50, 51, 52, 53, 54, 55, 200 + conv]))
    home.cached = set(system)
    mine = [900, 901, 902, 903, 904, 905, 906, 907]
    if repeat_cached:
        home.cached |= set(mine)  # the attacker's one prompt, cached there: it fills nothing
    for _ in range(40):
        req = _req("low", mine)
        req.tenant = "attacker"
        chooser.served(home, req)
        chooser.ended(home, req, ran=ran)
    home.inflight = 3
    picked = chooser.pick(_candidates(backends), _req("normal", [*system, 300]))
    assert picked is not None
    return picked


def test_requests_the_engine_did_not_run_leave_every_tenants_placement_as_it_was() -> None:
    home = _refused_flood_then_new_conversation(ran=False)
    assert home.cfg.url == "http://b0:80"
    # The control: the same 40 run, each filling eight new blocks there, and the home took
    # more than its share lately: the balance rule lets the new conversation start elsewhere.
    assert _refused_flood_then_new_conversation(ran=True).cfg.url == "http://b1:80"
    # One prompt of another tenant's repeated, cached at home: it fills nothing there.
    repeated = _refused_flood_then_new_conversation(ran=True, repeat_cached=True)
    assert repeated.cfg.url == "http://b0:80"


def test_a_refused_request_that_moved_a_prefix_home_moves_it_back() -> None:
    clock = FakeClock()
    hot, cool = backends = _backends()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, clock=clock, max_share=1.0)
    system = [1, 2]
    for conv in range(20):
        _place(chooser, [hot], _req("normal", [*system, 1000 + conv]))
    hot.cached = set(system)
    hot.inflight = 3
    moved = _req("normal", [*system, 2000])
    assert chooser.pick(_candidates(backends), moved) is cool  # the balance rule moves it
    chooser.served(cool, moved)
    chooser.ended(cool, moved, ran=False)  # ... but cool refused it: nothing moved
    hot.inflight = 0
    cool.cached = set(system)
    assert chooser.pick(_candidates(backends), _req("normal", [*system, 2001])) is hot


def test_recent_shares_take_no_vote_of_a_cached_prompt_and_undo_an_add() -> None:
    clock = FakeClock()
    counts = DecayingCounts(30.0, clock)
    counts.add("a", 10.0)
    for _ in range(40):
        counts.add("b", 0.0)  # prompts b had all cached: they fill nothing there
    assert counts.shares(at_least=2) == {}  # one add that weighed: too few to judge
    counts.add("b", 10.0)
    added_at = clock()
    clock.advance(30.0)
    counts.add("a", 10.0)
    counts.remove("b", 10.0, added_at)  # b's request did not run: as if never sent
    assert counts.shares(at_least=1) == pytest.approx({"a": 1.0, "b": 0.0})
    assert counts.weight("a") == pytest.approx(10.0 + 10.0 / math.e)
    assert counts.total() == pytest.approx(counts.weight("a") + counts.weight("b"))


def test_a_prompt_whose_blocks_are_unknown_goes_where_its_prefix_last_ran() -> None:
    a, b = backends = _backends()
    chooser = _chooser()
    turn = _req("normal", [1, 2, 3])
    turn.prefix_hash = 77
    assert _place(chooser, [b], turn) is b  # it ran on b
    blind = _req("normal", None, prompt=200)  # its tokens not had in time: no blocks
    blind.prefix_hash = 77
    a.inflight = b.inflight = 1
    assert chooser.pick(_candidates(backends), blind) is b
    # Another tenant's same prefix hash (salted apart in practice) has no home of it; nor
    # does a prefix whose request the engine refused.
    other = _req("normal", None, prompt=200)
    other.prefix_hash, other.tenant = 77, "u"
    refused = _req("normal", [9], prompt=200)
    refused.prefix_hash = 88
    chooser.served(a, refused)
    chooser.ended(a, refused, ran=False)
    blind_refused = _req("normal", None, prompt=200)
    blind_refused.prefix_hash = 88
    b.inflight = 2  # a has more room: by room, both go to a
    assert chooser.pick(_candidates(backends), other) is a
    assert chooser.pick(_candidates(backends), blind_refused) is a
    assert chooser.pick(_candidates(backends), blind) is b  # its prefix's home still


def _tenant_req(tenant: str, blocks: Sequence[int]) -> QueuedRequest:
    req = _req("normal", blocks)
    req.tenant = tenant
    return req


def test_a_tenants_first_conversation_under_anothers_preamble_starts_where_no_tenant_lives() -> (
    None
):
    # Issue 32, s32023: two tenants of one cache group followed their preamble onto one engine
    # while three idled, and each one's history evicted the other's (1.09x the prefill).
    home, b1, b2 = backends = _backends(3)
    chooser = _chooser()
    preamble = list(range(1, 9))
    assert _place(chooser, [home], _tenant_req("alice", [*preamble, 10, 11])) is home
    bobs = [*preamble, 20, 21]  # 8 of its 10 blocks sent to alice's home
    assert chooser.pick(_candidates(backends), _tenant_req("bob", bobs)) in (b1, b2)
    # The control: alice's own new conversation under it goes home.
    assert chooser.pick(_candidates(backends), _tenant_req("alice", [*preamble, 12])) is home
    # A stranger's one tiny request does not make an idle backend lived on (red team).
    _place(chooser, [b1], _tenant_req("stranger", [90]))
    _place(chooser, [b2], _tenant_req("another", [91]))
    assert chooser.pick(_candidates(backends), _tenant_req("bob", bobs)) in (b1, b2)
    # Once a tenant lives on every backend, bob joins the preamble: apart, it would only be
    # held twice.
    _place(chooser, [b1], _tenant_req("carol", list(range(40, 50))))
    _place(chooser, [b2], _tenant_req("dave", list(range(50, 60))))
    assert chooser.pick(_candidates(backends), _tenant_req("bob", bobs)) is home


def test_a_first_conversation_joins_its_preamble_where_each_backend_will_get_a_group() -> None:
    # Issue 32, s95051 (seven tenants in four cache groups on two engines): a group's second
    # tenant started apart while the other engine was still unlived, and held the group's
    # preamble twice (1.03x the prefill), though the other groups filled that engine later.
    backends = _backends(3)
    preamble = list(range(1, 9))
    for groups, joins in ((3, True), (2, False)):
        chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, cache_groups=groups)
        home = _place(chooser, [backends[0]], _tenant_req("alice", [*preamble, 10, 11]))
        picked = chooser.pick(_candidates(backends), _tenant_req("bob", [*preamble, 20, 21]))
        assert (picked is home) == joins, groups


def test_an_apart_start_moves_neither_the_preamble_home_of_its_first_tenant_nor_a_history() -> None:
    home, b1 = backends = _backends(2)
    chooser = _chooser()
    preamble = list(range(1, 11))
    assert _place(chooser, [home], _tenant_req("alice", [*preamble, 100])) is home
    # Bob's first conversation starts apart; its send of the preamble there does not move
    # alice's home (red team: her next conversations followed bob's send).
    assert _place(chooser, backends, _tenant_req("bob", [*preamble, 200])) is b1
    assert chooser.pick(_candidates(backends), _tenant_req("alice", [*preamble, 101])) is home
    # A history the index shows whole is not a first conversation, whatever the placement
    # memory lost of it (its pairs evicted by the tenant's own later work: red team).
    b1.cached = {*preamble, 300, 301, 302, 303}
    carols = [*preamble, 300, 301, 302, 303, 304]
    assert chooser.pick(_candidates(backends), _tenant_req("carol", carols)) is b1


def test_another_tenants_busy_backend_does_not_pin_a_first_conversation_that_would_start_apart() -> (
    None
):
    # Red team, 2026-12-04: mallory keeps the one backend no tenant lives on busy with a short
    # prompt repeated (cached: it fills nothing, so she lives nowhere). Bob's first
    # conversation under alice's preamble would start apart there, behind her 7 of 8 slots,
    # while the preamble's home is idle: it joins the preamble instead.
    home, lived, spare = backends = _backends(3)
    chooser = _chooser()
    preamble = list(range(1, 9))
    assert _place(chooser, [home], _tenant_req("alice", [*preamble, 10, 11])) is home
    _place(chooser, [lived], _tenant_req("carol", list(range(40, 50))))
    bobs = _tenant_req("bob", [*preamble, 20, 21])
    assert chooser.pick(_candidates(backends), bobs) is spare  # the control: idle, apart
    for _ in range(7):
        _place(chooser, [spare], _tenant_req("mallory", [60]))
    spare.inflight = 7  # her requests decoding there
    assert chooser.pick(_candidates(backends), bobs) is home
