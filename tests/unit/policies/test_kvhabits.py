"""How each tenant's conversations run lately (``proxy.policies.kvhabits``)."""

from __future__ import annotations

from proxy.policies.kvhabits import SWEEP_EVERY, TenantHabits
from tests.helpers.clock import FakeClock


def test_a_tenants_longest_prompt_and_most_requests_at_once_count_once_they_ran() -> None:
    habits = TenantHabits(FakeClock(), window_s=100.0)
    habits.sent("a1", "alice", 40)
    habits.sent("a2", "alice", 12)  # two of alice's at once
    assert (habits.longest("alice"), habits.side_by_side("alice")) == (0, 0)  # none ran yet
    habits.ended("a1", ran=True)
    habits.ended("a2", ran=True)
    assert (habits.longest("alice"), habits.side_by_side("alice")) == (40, 2)
    # One conversation at a time: never two in flight.
    for i in range(5):
        habits.sent(f"b{i}", "bob", 10 * i)
        habits.ended(f"b{i}", ran=True)
    assert (habits.longest("bob"), habits.side_by_side("bob")) == (40, 1)
    assert habits.longest("carol") == habits.side_by_side("carol") == 0  # never seen


def test_a_request_the_engine_did_not_run_counts_for_nothing_but_leaves_the_flight() -> None:
    habits = TenantHabits(FakeClock(), window_s=100.0)
    habits.sent("huge", "mallory", 3750)  # past the model's context: refused
    habits.sent("small", "mallory", 4)
    habits.ended("huge", ran=False)
    habits.ended("small", ran=True)
    assert (habits.longest("mallory"), habits.side_by_side("mallory")) == (4, 2)
    habits.ended("small", ran=True)  # twice: once
    habits.sent("next", "mallory", 4)
    habits.ended("next", ran=True)
    assert habits.side_by_side("mallory") == 2  # the earlier two at once; now one in flight


def test_habits_last_one_to_two_windows_then_the_tenants_ways_now_judge_it() -> None:
    clock = FakeClock()
    habits = TenantHabits(clock, window_s=100.0)
    habits.sent("a", "alice", 200)
    habits.sent("b", "alice", 200)
    habits.ended("a", ran=True)
    habits.ended("b", ran=True)
    clock.advance(150.0)  # the next window: the last one's still counts
    assert (habits.longest("alice"), habits.side_by_side("alice")) == (200, 2)
    habits.sent("c", "alice", 10)
    habits.ended("c", ran=True)
    clock.advance(100.0)  # two windows on: only what it did in the last one
    assert (habits.longest("alice"), habits.side_by_side("alice")) == (10, 1)
    clock.advance(500.0)
    assert (habits.longest("alice"), habits.side_by_side("alice")) == (0, 0)


def test_habits_are_kept_only_for_tenants_active_lately() -> None:
    clock = FakeClock()
    habits = TenantHabits(clock, window_s=10.0)
    for i in range(3 * SWEEP_EVERY):
        habits.sent(i, f"t{i}", 5)
        habits.ended(i, ran=True)
        clock.advance(1.0)
    # Swept every SWEEP_EVERY sends: those faded two windows (20 s) before a sweep are gone.
    assert len(habits) <= SWEEP_EVERY + 20
    habits.sent("left", "keeps", 5)  # in flight across any sweep: kept
    for i in range(SWEEP_EVERY):
        habits.sent(("x", i), "other", 5)
        habits.ended(("x", i), ran=True)
        clock.advance(1.0)
    habits.ended("left", ran=True)
    assert habits.longest("keeps") == 5
