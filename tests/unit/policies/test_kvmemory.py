"""kv_aware's placement memory (proxy.policies.kvmemory): what was in flight, what ran and is
kept, what leaves no trace, and each tenant's share of the room. An injected clock, no sleep."""

from __future__ import annotations

from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.kvaware import KvAware
from proxy.policies.kvmemory import PlacementMemory
from proxy.policies.types import QueuedRequest
from tests.helpers.clock import FakeClock

A, B = "http://a:80", "http://b:80"


def _memory(capacity: int = 100, clock: FakeClock | None = None) -> PlacementMemory:
    return PlacementMemory(capacity, pending_s=10.0, clock=clock or FakeClock())


def test_a_flight_is_home_and_pending_until_it_ends_and_a_refused_one_leaves_nothing() -> None:
    clock = FakeClock()
    memory = _memory(clock=clock)
    key = object()
    memory.sent(key, "t", A, [1, 2, 3])
    assert memory.home([1, 2, 3, 4]) == (A, 3)
    assert memory.pending_run(A, [1, 2, 3, 4]) == 3 and memory.pending_run(B, [1, 2]) == 0
    clock.advance(10.1)  # pending for pending_s only (the index shows it by then); still home
    assert memory.pending_run(A, [1, 2, 3]) == 0 and memory.home([1, 2, 3]) == (A, 3)
    assert memory.ended(key, ran=False) is None  # a 4xx, a failed connection: no trace
    assert memory.home([1, 2, 3]) == (None, 0) and memory.kept_by_tenant() == {}
    assert memory.in_flight() == 0


def test_what_ran_is_kept_pending_until_pending_s_after_it_was_sent() -> None:
    clock = FakeClock()
    memory = _memory(clock=clock)
    key = object()
    memory.sent(key, "t", A, [1, 2])
    clock.advance(4.0)
    assert memory.ended(key, ran=True) is not None
    assert memory.ended(key, ran=True) is None  # once only
    assert memory.pending_run(A, [1, 2, 9]) == 2 and memory.home([1, 2, 9]) == (A, 2)
    clock.advance(6.1)
    assert memory.pending_run(A, [1, 2]) == 0 and memory.home([1, 2]) == (A, 2)
    assert memory.kept_by_tenant() == {"t": 2}


def test_the_newest_flight_of_a_shared_block_is_its_home() -> None:
    memory = _memory()
    first, second = object(), object()
    memory.sent(first, "t", A, [1, 2])
    memory.sent(second, "u", B, [1, 3])
    assert memory.home([1, 5]) == (B, 1) and memory.home([1, 2]) == (A, 2)
    memory.ended(second, ran=False)
    assert memory.home([1, 5]) == (A, 1)
    assert memory.pending_run(B, [1]) == 0 and memory.pending_run(A, [1]) == 1


def test_a_flood_that_never_ran_evicts_nothing_even_past_the_room() -> None:
    memory = _memory(capacity=50)
    placed = object()
    memory.sent(placed, "quiet", A, range(40))
    memory.ended(placed, ran=True)
    for n in range(40):  # far past the room, each refused by the engine
        key = object()
        memory.sent(key, "flood", B, range(1000 * (n + 1), 1000 * (n + 1) + 3750))
        memory.ended(key, ran=False)
    assert memory.home(list(range(40))) == (A, 40)
    assert memory.kept_by_tenant() == {"quiet": 40}


def test_a_tenant_that_sends_more_than_its_share_evicts_its_own_placement_first() -> None:
    memory = _memory(capacity=100)
    for tenant, url, base in (("quiet", A, 0), ("other", B, 500)):
        key = object()
        memory.sent(key, tenant, url, range(base, base + 30))
        memory.ended(key, ran=True)
    for n in range(50):  # real work, but far more than its share of the room
        key = object()
        memory.sent(key, "flood", B, range(10_000 + 100 * n, 10_000 + 100 * n + 20))
        memory.ended(key, ran=True)
    kept = memory.kept_by_tenant()
    assert kept == {"quiet": 30, "other": 30, "flood": 40}  # within the room, max-min fair
    assert memory.placement() == {"quiet": {A: 30}, "other": {B: 30}, "flood": {B: 40}}
    assert memory.home(list(range(30))) == (A, 30)
    assert memory.home(list(range(500, 530))) == (B, 30)
    newest = list(range(10_000 + 4900, 10_000 + 4920))
    assert memory.home(newest) == (B, 20)  # the flood kept its latest prompts
    assert memory.home(list(range(10_000, 10_020))) == (None, 0)


def test_a_tenant_over_its_share_loses_to_one_under_it() -> None:
    memory = _memory(capacity=60)
    big = object()
    memory.sent(big, "big", A, range(60))  # the whole room while alone
    memory.ended(big, ran=True)
    small = object()
    memory.sent(small, "small", B, range(100, 120))
    memory.ended(small, ran=True)
    assert memory.kept_by_tenant() == {"big": 40, "small": 20}
    # Its least recently sent pairs went; the deepest blocks still say where its prompt lives.
    assert memory.home(list(range(60))) == (A, 60)
    assert memory.pending_run(A, list(range(20))) == 0


def test_a_block_two_tenants_keep_stays_home_where_one_keeps_it_when_the_others_pair_goes() -> None:
    """Tenants of one cache group share block hashes: B keeps its system prompt on A, the
    group's other tenant on B, sent last (the block's home). The other's flood evicts its own
    pair; the prompt's home falls back to where B keeps it, not to nothing."""
    clock = FakeClock()
    memory = _memory(capacity=20, clock=clock)
    system = [1, 2, 3, 4]
    for tenant, url in (("b", A), ("other", B)):
        key = object()
        memory.sent(key, tenant, url, system)
        memory.ended(key, ran=True)
        clock.advance(1.0)
    assert memory.home(system) == (B, 4)
    for n in range(10):  # the other tenant's own work, past its share of the room
        key = object()
        memory.sent(key, "other", B, [1000 + 2 * n, 1001 + 2 * n])
        memory.ended(key, ran=True)
    assert memory.placement()["b"] == {A: 4}
    assert memory.home([1000, 1001]) == (None, 0)  # the flood lost its own oldest first
    assert memory.home(system) == (A, 4)


def test_the_pool_tells_kv_aware_how_each_request_ended() -> None:
    chooser = KvAware(block_size=16, latency_weights={"n": 1.0}, clock=FakeClock())
    pool = BackendPool([Backend(url=A, max_inflight=4)], BackendHealth(), chooser)
    (state,) = pool.all()
    ran, refused = (QueuedRequest("n", t, 100, 10, 0.0) for t in ("quiet", "flood"))
    ran.prompt_blocks, refused.prompt_blocks = (1, 2, 3), (7, 8, 9)
    for req in (ran, refused):
        pool.acquire(state, 10, request=req)
    assert chooser.memory.in_flight() == 2
    pool.release(state, 10, request=refused, ran=False)  # the engine answered 400
    pool.release(state, 10, request=ran)
    assert chooser.memory.kept_by_tenant() == {"quiet": 3}
    assert chooser.memory.home([7, 8, 9]) == (None, 0) and state.inflight == 0


def test_whether_a_tenant_itself_sent_a_block_in_flight_or_kept_and_not_once_its_pair_went() -> (
    None
):
    memory = _memory(capacity=6)
    alice, bob = object(), object()
    memory.sent(alice, "alice", A, [1, 2])
    # In flight: alice sent block 2; bob, of her cache group, did not.
    assert memory.sent_by("alice", 2) and not memory.sent_by("bob", 2)
    memory.ended(alice, ran=True)
    assert memory.sent_by("alice", 2) and not memory.sent_by("bob", 2)  # kept
    memory.sent(bob, "bob", B, [1, 2, 3])
    memory.ended(bob, ran=True)
    assert memory.sent_by("bob", 2)  # kept on B: bob sent it too
    flood = object()
    memory.sent(flood, "alice", A, [7, 8, 9])  # alice's own flood evicts her oldest pairs
    memory.ended(flood, ran=True)
    assert not memory.sent_by("alice", 1) and not memory.sent_by("alice", 2)
    assert memory.sent_by("bob", 1) and memory.sent_by("alice", 7)
    assert not memory.sent_by("carol", 1)  # never seen


def test_a_tenants_home_for_a_block_it_sent_is_where_it_last_sent_it_whoever_sent_it_since() -> (
    None
):
    memory = _memory()
    alice, bob = object(), object()
    memory.sent(alice, "alice", A, [1, 2])
    memory.ended(alice, ran=True)
    memory.sent(bob, "bob", B, [1, 2, 3])  # bob of her cache group, in flight elsewhere
    assert memory.home([1, 2, 9], "alice") == (A, 2)  # hers: where she sent it
    assert memory.home([1, 2, 9], "carol") == (B, 2)  # who never sent it: the newest send
    assert memory.home([1, 2, 9]) == (B, 2)
    memory.ended(bob, ran=True)
    assert memory.home([1, 2, 9], "alice") == (A, 2) and memory.home([1, 2, 3], "alice") == (B, 3)
