"""The suite's own engine plan (tests/helpers/engineplan.py) and the farm that follows it
(tests/helpers/enginefarm.py), with engines that start nothing: each setting starts once, ahead
of its tests while tests that need none run, never more than the capacity live, stopped after
its last use."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from proxy.tools.engine import EngineSpec
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engineplan import order, split, waves
from tests.helpers.engines import EngineSetting

C, B, P, L, S, G, E = (EngineSetting(n) for n in ("c", "b", "p", "l", "s", "g", "e"))
NONE: frozenset[EngineSetting] = frozenset()


def the_suite() -> list[frozenset[EngineSetting]]:
    """The shape of tests/ today, in collection order: engine-free modules and the engine
    modules (compat, integration) with what they use (pooling p beside c; plugin s with g)."""
    mods = [NONE] * 9 + [frozenset({L}), frozenset({E}), frozenset({L})]
    mods += [frozenset({C, B}), *[frozenset({C})] * 3, frozenset({S, G}), frozenset({L})]
    mods += [frozenset({L}), frozenset({C}), frozenset({P, C}), frozenset({C}), frozenset({C})]
    return mods + [NONE] * 40


def test_waves_keep_settings_used_together_and_start_each_once() -> None:
    planned = waves(the_suite(), capacity=3)
    settings = [s for w in planned for s in w.settings]
    assert sorted(settings, key=lambda s: s.name) == sorted(
        {C, B, P, L, S, G, E}, key=lambda s: s.name
    )
    assert all(len(w.settings) <= 3 for w in planned)
    # c, b and p are used together (two modules share c): one wave.
    assert any({C, B, P} <= w.settings for w in planned)
    units = sorted(u for w in planned for u in w.units)
    assert units == [i for i, need in enumerate(the_suite()) if need]


def test_a_group_larger_than_the_capacity_still_runs_in_one_wave() -> None:
    needs = [frozenset({C, B}), frozenset({B, P}), frozenset({E})]
    planned = waves(needs, capacity=2)
    assert [w.settings for w in planned] == [frozenset({C, B, P}), frozenset({E})]


def test_order_runs_every_module_once_whole_with_a_filler_before_each_wave() -> None:
    needs = the_suite()
    run = order(needs, [1] * len(needs), capacity=3)
    assert sorted(run) == list(range(len(needs)))
    planned = waves(needs, capacity=3)
    assert len(planned) > 1
    at = 0
    for wave in planned:
        assert not needs[run[at]], "each wave comes after engine-free modules"
        while not needs[run[at]]:
            at += 1
        assert tuple(run[at : at + len(wave.units)]) == wave.units
        at += len(wave.units)


def test_in_a_wave_modules_using_fewer_settings_run_first_the_quiet_ones_first_among_equals() -> (
    None
):
    needs = [frozenset({C, B}), frozenset({C}), frozenset({P, C}), frozenset({C})]
    assert waves(needs, capacity=3)[0].units == (1, 3, 0, 2)
    assert waves(needs, capacity=3, quiet=[False, False, False, True])[0].units == (3, 1, 0, 2)


def test_a_module_that_restarts_an_engine_runs_after_every_other_user_of_it() -> None:
    needs = [frozenset("a"), frozenset("a"), frozenset("ab"), frozenset("a")]
    restarts = [False, True, False, False]
    assert waves(needs, capacity=3, restarts=restarts)[0].units == (0, 3, 2, 1)


def test_split_follows_the_shares_by_weight() -> None:
    assert split(list(range(8)), [1] * 8, [3, 1]) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert split([0, 1, 2], [10, 1, 1], [1, 1]) == [[0], [1, 2]]
    assert split([], [], [2, 1]) == [[], []]


class FakeEngine:
    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.running = False

    def start(self) -> FakeEngine:
        self.running = True
        return self

    def alive(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.running

    def ready(self) -> bool:
        return False  # never seen ready between tests: a start is waited for


def run_plan(
    farm: EngineFarm, plan: list[frozenset[EngineSetting]], quiet: list[bool] | None = None
) -> tuple[list[str], list[str]]:
    """Each test of ``plan`` run against the farm: the settings launched, and when ("ahead":
    before a test that does not use it; "for its test": before a test that uses it; "in get":
    when a test asked); checks that live engines stay within the capacity."""
    launched_at: list[str] = []
    quiet = quiet or [False] * len(plan)
    farm.follow(plan, quiet)
    for position, need in enumerate(plan):
        before = len(farm.starts)
        farm.advance(position)
        launched_at += [
            "for its test" if start.setting in {s.name for s in need} else "ahead"
            for start in farm.starts[before:]
        ]
        # A test's own engines are ready when it runs; beside a quiet one nothing starts.
        assert not need & farm.pending.keys()
        assert not (need and quiet[position] and farm.pending)
        before = len(farm.starts)
        for setting in sorted(need, key=lambda s: s.name):
            assert farm.get(setting).alive()
        launched_at += ["in get"] * (len(farm.starts) - before)
        assert len(farm.live) <= farm.capacity
        # Nothing live that no later test uses.
        assert set(farm.live) <= set().union(*plan[position:])
    farm.stop_all()
    return [s.setting for s in farm.starts], launched_at


def make_farm(tmp_path: Path, capacity: int = 3, memory_gib: float = 64.0) -> EngineFarm:
    return EngineFarm(
        tmp_path,
        lambda: tmp_path,
        capacity,
        memory_gib=lambda: memory_gib,
        launch=cast(Any, FakeEngine),
    )


def test_the_suites_plan_starts_each_engine_once_and_all_ahead(tmp_path: Path) -> None:
    needs = the_suite()
    tests_per_module = 5
    plan = [needs[i] for i in order(needs, [tests_per_module] * len(needs), 3)]
    plan = [need for need in plan for _ in range(tests_per_module)]
    started, launched_at = run_plan(make_farm(tmp_path), plan)
    assert sorted(started) == sorted(s.name for s in (C, B, P, L, S, G, E))
    assert launched_at == ["ahead"] * len(started)


def test_engines_start_ahead_beside_a_test_that_uses_engines_but_not_a_quiet_one(
    tmp_path: Path,
) -> None:
    plan = [frozenset({C}), frozenset({C}), frozenset({B})]
    started, launched_at = run_plan(make_farm(tmp_path), plan)
    assert started == ["c", "b"] and launched_at == ["for its test", "ahead"]
    started, launched_at = run_plan(make_farm(tmp_path), plan, [True, True, False])
    assert started == ["c", "b"] and launched_at == ["for its test", "for its test"]


def test_a_test_waits_for_its_own_engines_not_for_a_start_ahead(tmp_path: Path) -> None:
    farm = make_farm(tmp_path)
    farm.follow([frozenset({C}), frozenset({C}), frozenset({C, B})])
    farm.advance(0)  # c started for it and waited for; b started ahead beside it
    assert C in farm.live and farm.pending.keys() == {B}
    farm.advance(1)  # b still starting: this test uses only c, so it runs beside the start
    assert farm.pending.keys() == {B}
    farm.advance(2)
    assert not farm.pending


def test_in_collection_order_an_engine_starts_again(tmp_path: Path) -> None:
    """What the plan prevents: run as collected, the capacity forces a second start."""
    started, _ = run_plan(make_farm(tmp_path), the_suite())
    assert len(started) > len(set(started))


def test_a_farm_that_does_not_start_ahead_starts_each_engine_for_its_test(tmp_path: Path) -> None:
    """A pytest-xdist worker's farm: it runs only the tests it is sent, so an engine starts
    when one of them needs it (three workers had each started a LoRA engine ahead)."""
    farm = make_farm(tmp_path)
    farm.ahead = False
    started, launched_at = run_plan(farm, [NONE, frozenset({C}), NONE, frozenset({B})])
    assert started == ["c", "b"] and launched_at == ["for its test", "for its test"]


def test_no_start_ahead_without_memory_for_one_more(tmp_path: Path) -> None:
    plan = [NONE, NONE, frozenset({C})]
    farm = make_farm(tmp_path, memory_gib=2.0)
    started, launched_at = run_plan(farm, plan)
    assert started == ["c"] and launched_at == ["for its test"]
    assert not farm.starts[0].ahead


def test_the_engines_a_test_needs_start_together_before_it_asks(tmp_path: Path) -> None:
    farm = make_farm(tmp_path)
    farm.follow([frozenset({S, G}), frozenset({S, G})])
    farm.advance(0)
    assert set(farm.live) == {S, G} and all(e.alive() for e in farm.live.values())
    assert not any(start.ahead for start in farm.starts)
    farm.get(S)
    farm.get(G)
    farm.advance(1)
    assert len(farm.starts) == 2
    farm.stop_all()


def test_every_start_ahead_is_waited_for_before_a_quiet_test(tmp_path: Path) -> None:
    farm = make_farm(tmp_path)
    farm.follow([NONE, frozenset({C}), frozenset({B})], [False, True, False])
    farm.advance(0)
    assert set(farm.pending) == {C, B}
    farm.advance(1)
    assert not farm.pending and all(start.ready_s is not None for start in farm.starts)
    farm.stop_all()


def test_an_undeclared_engine_is_refused(tmp_path: Path) -> None:
    farm = make_farm(tmp_path)
    farm.follow([frozenset({C})])
    farm.advance(0)
    with pytest.raises(RuntimeError, match="not declared"):
        farm.get(B)
    farm.stop_all()


def test_a_dead_engine_is_started_again(tmp_path: Path) -> None:
    farm = make_farm(tmp_path)
    farm.follow([frozenset({C}), frozenset({C})])
    farm.advance(0)
    first = farm.get(C)
    first.stop()
    farm.advance(1)
    assert farm.get(C) is not first and len(farm.starts) == 2
    farm.stop_all()


def test_a_test_starts_from_idle_engines_and_work_left_before_it_is_recorded(
    tmp_path: Path,
) -> None:
    """Before each test that uses engines the farm polls each of its live engines until vLLM
    runs and queues nothing, and records the work it found with the test that ran before."""
    queues = {"c": [(0.0, 0.0)], "b": [(0.0, 0.0), (2.0, 1.0), (1.0, 0.0), (0.0, 0.0)]}
    polls: list[str] = []

    def queue_of(engine: Any) -> tuple[float, float]:
        setting = next(s.name for s, e in farm.live.items() if e is engine)
        polls.append(setting)
        found = queues[setting]
        return found.pop(0) if len(found) > 1 else found[0]

    farm = EngineFarm(tmp_path, lambda: tmp_path, 3, memory_gib=lambda: 64.0, launch=cast(Any, FakeEngine), queue_of=queue_of, pause=lambda s: None)  # fmt: skip
    farm.follow([frozenset({C, B}), NONE, frozenset({C, B})])
    for position, test in enumerate(["first", "no engines", "third"]):
        farm.advance(position)
        for setting in sorted(farm.plan[position], key=lambda s: s.name):
            farm.get(setting)
        farm.until_idle(test)
    [left] = farm.leftovers
    assert (left.before, left.test, left.setting) == ("first", "third", "b")
    assert (left.running, left.waiting) == (2.0, 1.0) and left.idle_after_s is not None
    assert polls == ["b", "c", "b", "b", "b", "c"]  # the third test's: b until idle, then c
    assert "1 found work left in vLLM" in farm.summary()
    assert "first\tthird\tb\t2\t1\t" in farm.leftovers_report()
