"""kv_aware's shared prefixes and their homes (proxy.policies.kvgroups): learned only from work
that ran, each tenant's branch points in its share of the room. An injected clock, no sleep."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.config.backends import Backend
from proxy.policies.backends import Candidate
from proxy.policies.kvaware import KvAware
from proxy.policies.kvgroups import PrefixGroups, TenantLru
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import QueuedRequest
from tests.helpers.clock import FakeClock
from tests.unit.policies.test_kvaware import FakeBackend

BLOCK = 32
WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=4.0, worst=0.25)
A, B = "http://a:80", "http://b:80"


def test_past_the_room_the_tenant_keeping_the_most_loses_its_least_recently_used() -> None:
    lru = TenantLru[str](6)
    lru.put("quiet", 1, A)
    lru.put("quiet", 2, A)
    for key in range(100, 120):
        lru.put("loud", key, B)
    assert lru.get(1) == lru.get(2) == A  # under its share (3 of 6): never another's victim
    assert lru.kept_by_tenant() == {"quiet": 2, "loud": 4}
    assert [lru.get(k) for k in (115, 116, 117, 118, 119)] == [None, B, B, B, B]
    lru.touch("loud", 116)  # used again: the loud tenant's oldest is 117 now
    lru.put("loud", 200, B)
    assert lru.get(116) == B and lru.get(117) is None
    # One alone may use the whole room; a key two tenants keep stays while one keeps it.
    shared = TenantLru[str](4)
    shared.put("a", 7, A)
    shared.touch("b", 7)
    shared.set(7, B)  # a value changed in place: nobody keeps it longer for that
    for key in range(10, 14):
        shared.put("a", key, A)
    assert shared.get(7) == B and shared.kept_by_tenant() == {"a": 3, "b": 1}
    shared.put("b", 20, A)  # past the room: a keeps the most, its oldest goes (10)
    assert shared.get(10) is None and shared.get(7) == B
    shared.put("b", 21, A)  # now b keeps the most: its oldest, 7, which a no longer keeps
    assert shared.get(7) is None and len(shared) == 4


def test_a_branch_point_comes_of_two_next_blocks_that_ran_and_is_kept_while_in_use() -> None:
    groups = PrefixGroups(4)
    groups.note("t", [1, 2, 3, 10], 3, A)
    assert groups.home(3) is None  # one next block: a conversation's turn, not a branch
    groups.note("t", [1, 2, 3, 10, 11], 4, A)  # its next turn: no branch either
    assert groups.home(3) is None and groups.home(10) is None
    groups.note("t", [1, 2, 3, 20], 3, A)
    assert groups.home(3) == A
    for point in range(50, 53):  # three more branch points of the same tenant
        groups.note("t", [point, 1], 1, B)
        groups.note("t", [point, 2], 1, B)
    groups.note("t", [1, 2, 3, 30], 3, B)  # a new branch of 3 ran: used, kept, home unmoved
    groups.note("t", [60, 1], 1, B)
    groups.note("t", [60, 2], 1, B)  # past the room: the least recently used point goes
    assert groups.home(3) == A and groups.home(50) is None and groups.home(60) == B


def test_a_prompt_going_on_otherwise_past_a_point_that_ran_starts_a_branch() -> None:
    # A tenant's second conversation is a new branch before its third makes a branch point:
    # the spread rule moves new branches, and a tenant of a few conversations has no third.
    groups = PrefixGroups(4)
    assert not groups.branches([1, 2, 3, 20], 3)  # nothing ran past 3
    groups.note("t", [1, 2, 3, 10], 3, A)
    assert groups.branches([1, 2, 3, 20], 3) and groups.home(3) is None
    assert not groups.branches([1, 2, 3, 10, 11], 3)  # the same conversation's next turn
    assert not groups.branches([1, 2, 3], 3) and not groups.branches([1, 2], 0)  # nothing past
    groups.note("t", [1, 2, 3, 20], 3, A)
    assert groups.branches([1, 2, 3, 30], 3) and groups.branches([1, 2, 3, 10], 3)  # any child


def _chooser(clock: FakeClock, memory: int) -> KvAware:
    # The spread and balance rules apart: where the flood runs does not move the victim.
    return KvAware(
        block_size=BLOCK, latency_weights=WEIGHTS, clock=clock, max_share=1.0,
        pending_blocks=memory,
    )  # fmt: skip


def _req(tenant: str, blocks: Sequence[int]) -> QueuedRequest:
    req = QueuedRequest("normal", tenant, BLOCK * len(blocks) + 10, 16, arrival_s=0.0)
    req.prompt_blocks = tuple(blocks)
    return req


def _run(
    chooser: KvAware, on: FakeBackend, req: QueuedRequest, *, ran: bool = True
) -> FakeBackend | None:
    picked = chooser.pick([Candidate(on, on.max_room - on.inflight, None)], req)
    assert picked is on
    chooser.served(on, req)
    chooser.ended(on, req, ran=ran)
    return picked


def _flood_then_new_conversation(*, flood_ran: bool) -> tuple[FakeBackend, PrefixGroups]:
    """The victim's system prompt becomes a branch point at home ``a``; one conversation ran
    on ``b`` (``a`` was full), so the prompt's blocks were last sent to ``b``. Another tenant
    runs 200 prompts of its own that make 100 branch points, past the chooser's room (64)
    many times, on ``b``. Where does the victim's next new conversation go, at equal load?"""
    clock = FakeClock()
    a, b = FakeBackend(Backend(url=A)), FakeBackend(Backend(url=B))
    chooser = _chooser(clock, memory=64)
    system = [1, 2, 3]
    for conv in (10, 20):
        _run(chooser, a, _req("victim", [*system, conv]))
    _run(chooser, b, _req("victim", [*system, 30]))
    clock.advance(1.0)
    for point in range(1000, 1100):
        _run(chooser, b, _req("flood", [point]), ran=flood_ran)
        for child in (1, 2):
            _run(chooser, b, _req("flood", [point, point * 10 + child]), ran=flood_ran)
        clock.advance(0.05)
    clock.advance(60.0)  # the shares lately and pending flights fade: the room alone counts
    a.cached = b.cached = set(system)
    new = _req("victim", [*system, 40])
    picked = chooser.pick([Candidate(x, x.max_room, None) for x in (a, b)], new)
    assert picked is not None
    return picked, chooser._groups


def test_one_tenants_flood_of_branch_points_cannot_evict_another_tenants() -> None:
    picked, groups = _flood_then_new_conversation(flood_ran=True)
    assert groups.kept_by_tenant()["flood"] > 32  # past its share: it evicted its own
    assert picked.cfg.url == A, "the victim's new conversation left its system prompt's home"


def test_a_flood_that_did_not_run_notes_no_branch_point() -> None:
    picked, groups = _flood_then_new_conversation(flood_ran=False)
    assert groups.kept_by_tenant() == {"victim": 1}
    assert picked.cfg.url == A
