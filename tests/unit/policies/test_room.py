"""The adaptive backend room on a simulated vLLM, with an injected clock (no sockets, no sleeps).

The simulated engine runs at most ``max_num_seqs`` requests and queues the rest, as vLLM's
scheduler does; the proxy keeps its room full when demand exceeds it; the monitor scrapes and
the controller looks every 0.5 s, as in the server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from proxy.backends.backend import BackendState
from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.config.slo import AdaptiveRoom
from proxy.policies.backends import LeastUtilised
from proxy.policies.room import FixedRoom, GradientRoom, RoomChange
from proxy.policies.types import ScrapedLoad
from tests.helpers.clock import FakeClock

HEALTH = BackendHealth(max_backend_waiting=2, stale_after_s=2.0)
TICK_S = 0.5


@dataclass
class SimEngine:
    """What vLLM's /metrics would say: it runs up to max_num_seqs, queues the rest."""

    max_num_seqs: int
    kv_per_seq: float = 0.0  # KV-cache share one running request takes
    preemptions: float = 0.0
    # Every other scrape falls between steps: this many have finished and their successors
    # still wait for the next step.
    between_steps: int = 0
    # The proxy's requests vLLM's scheduler does not hold: still in its API server on the
    # way in, or done and streaming out.
    in_transit: int = 0
    history: list[float] = field(default_factory=list)
    scrapes: int = 0

    def scrape(self, inflight: int, now: float) -> ScrapedLoad:
        self.scrapes += 1
        inflight = max(0, inflight - self.in_transit)  # what vLLM's scheduler holds
        running = min(inflight, self.max_num_seqs)
        if self.scrapes % 2:
            running = max(0, running - self.between_steps)
        kv = min(1.0, running * self.kv_per_seq)
        return ScrapedLoad(
            waiting=float(inflight - running),
            running=float(running),
            kv_usage=kv,
            at=now,
            preemptions=self.preemptions,
        )


def _pool(backend: Backend, params: AdaptiveRoom | None = None) -> BackendPool:
    return BackendPool([backend], HEALTH, LeastUtilised(), params or AdaptiveRoom())


def _run(
    pool: BackendPool,
    engine: SimEngine,
    clock: FakeClock,
    seconds: float,
    demand: int,
    *,
    scrape: bool = True,
) -> list[RoomChange]:
    """Constant demand for ``seconds``: the proxy fills the room up to the demand, the monitor
    scrapes and ticks the room each pass."""
    state = pool.all()[0]
    changes: list[RoomChange] = []
    end = clock() + seconds
    while clock() < end:
        target = min(demand, int(state.max_room))
        while state.inflight < target:
            pool.acquire(state, 1.0)
        while state.inflight > target:  # requests end; fewer take their place
            pool.release(state, 1.0)
        if scrape:
            state.load = engine.scrape(state.inflight, clock())
        change = pool.tick_room(state, clock())
        if change is not None:
            changes.append(change)
        engine.history.append(state.max_room)
        clock.advance(TICK_S)
    return changes


@pytest.mark.parametrize("max_num_seqs", [4, 16, 64])
def test_room_converges_to_the_engine_batch_and_then_holds_still(
    clock: FakeClock, max_num_seqs: int
) -> None:
    pool = _pool(Backend(url="http://e:1"))
    engine = SimEngine(max_num_seqs)
    _run(pool, engine, clock, 30.0, demand=500)
    # vLLM's batch plus the allowance HEALTH.max_backend_waiting = 2 that keeps it full.
    assert pool.all()[0].max_room == max_num_seqs + 2
    later = _run(pool, engine, clock, 120.0, demand=500)
    assert later == []  # no oscillation under constant load


def test_a_scrape_between_steps_does_not_pull_the_room_under_the_batch(clock: FakeClock) -> None:
    """Half the scrapes see 3 of the 16 sequences just finished and their successors waiting:
    the room still settles at the batch the engine runs (16) plus the allowance."""
    pool = _pool(Backend(url="http://e:1"))
    engine = SimEngine(16, between_steps=3)
    _run(pool, engine, clock, 30.0, demand=500)
    assert pool.all()[0].max_room == 18
    assert _run(pool, engine, clock, 120.0, demand=500) == []


@pytest.mark.parametrize("max_num_seqs", [4, 64])
def test_room_covers_the_requests_in_transit_and_then_holds_still(
    clock: FakeClock, max_num_seqs: int
) -> None:
    """16 of the proxy's requests are always in vLLM's API server (busy, on its way in or out):
    the room is vLLM's batch plus the allowance plus those 16, so that the batch stays full."""
    pool = _pool(Backend(url="http://e:1"))
    engine = SimEngine(max_num_seqs, in_transit=16)
    _run(pool, engine, clock, 60.0, demand=500)
    assert pool.all()[0].max_room == max_num_seqs + 2 + 16
    assert _run(pool, engine, clock, 120.0, demand=500) == []


@dataclass
class NoisyTransitEngine(SimEngine):
    """The requests in transit change at every scrape (5 to 35, 20 on average), as on a busy
    CPU engine's API server."""

    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def scrape(self, inflight: int, now: float) -> ScrapedLoad:
        self.in_transit = self.rng.randint(5, 35)
        return super().scrape(inflight, now)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_noisy_transit_moves_the_room_rarely_and_little(clock: FakeClock, seed: int) -> None:
    pool = _pool(Backend(url="http://e:1"))
    engine = NoisyTransitEngine(64, rng=random.Random(seed))
    _run(pool, engine, clock, 30.0, demand=500)
    later = _run(pool, engine, clock, 120.0, demand=500)
    # vLLM's batch + the allowance + the mean transit = 86: the room stays near it, and moves
    # a few times in two minutes at most (one snapshot's queue or transit decides nothing).
    assert len(later) <= 4, later
    assert all(80 <= room <= 100 for room in engine.history[-240:])


@dataclass
class SwingingEngine(SimEngine):
    """Requests of one length end together: every other scrape finds vLLM's batch and about
    two waiting, the others still in its API server; the others find them all in its queue
    (as real vLLM on the quiet CI machine: waiting 12, 1, 12, 2, ... at a room of 16)."""

    def scrape(self, inflight: int, now: float) -> ScrapedLoad:
        trough = self.scrapes % 2 == 0  # the parent counts this scrape first
        self.in_transit = max(0, inflight - (self.max_num_seqs + 2)) if trough else 0
        return super().scrape(inflight, now)


def test_a_queue_swinging_with_the_scrapes_still_shrinks_the_room(clock: FakeClock) -> None:
    """Never "queued in every scrape", yet the batch ran full in each and the queue held far
    more than the allowance on average: the room comes down from 16, by half the excess at a
    time, and then holds still."""
    pool = _pool(Backend(url="http://e:1"), AdaptiveRoom(initial_room=16))
    engine = SwingingEngine(4)
    changes = _run(pool, engine, clock, 30.0, demand=500)
    room = pool.all()[0].max_room
    assert changes and all(c.reason == "queued" for c in changes), changes
    assert 6 <= room <= 12, engine.history
    assert _run(pool, engine, clock, 120.0, demand=500) == []


def test_room_does_not_grow_past_unused_room_or_the_ceiling(clock: FakeClock) -> None:
    pool = _pool(Backend(url="http://e:1"))
    changes = _run(pool, SimEngine(64), clock, 30.0, demand=5)
    assert changes == [] and pool.all()[0].max_room == 8  # demand 5 never fills 8
    capped = _pool(Backend(url="http://e:1", max_inflight=20, adaptive=True))
    _run(capped, SimEngine(64), clock, 30.0, demand=500)
    assert capped.all()[0].max_room == 20


def test_stale_metrics_keep_the_last_good_room(clock: FakeClock) -> None:
    pool = _pool(Backend(url="http://e:1"))
    engine = SimEngine(16)
    _run(pool, engine, clock, 30.0, demand=500)
    learned = pool.all()[0].max_room
    # Scrapes stop (the backend's /metrics hangs): the old load goes stale, nothing changes
    # although the proxy keeps the room full.
    assert _run(pool, engine, clock, 60.0, demand=500, scrape=False) == []
    assert pool.all()[0].max_room == learned


def test_preemptions_shrink_the_room(clock: FakeClock) -> None:
    pool = _pool(Backend(url="http://e:1"))
    engine = SimEngine(64)
    _run(pool, engine, clock, 30.0, demand=500)
    assert pool.all()[0].max_room == 66
    engine.preemptions += 3  # with KV to spare: the plugin's, for a better tier
    assert _run(pool, engine, clock, 3.0, demand=500) == []
    engine.kv_per_seq = 0.9 / 64  # KV nearly full
    engine.preemptions += 3  # KV ran out: vLLM preempted
    changes = _run(pool, engine, clock, 1.0, demand=500)
    assert [c.reason for c in changes] == ["preempted"]
    assert pool.all()[0].max_room == int(66 * AdaptiveRoom().decrease_ratio)


def test_high_kv_usage_stops_growth(clock: FakeClock) -> None:
    pool = _pool(Backend(url="http://e:1"))
    _run(pool, SimEngine(64, kv_per_seq=0.1), clock, 30.0, demand=500)
    # Doubling stops once a scrape shows KV usage over kv_high (0.9): 8 -> 16, no further.
    assert pool.all()[0].max_room == 16


def test_slipping_targets_shrink_and_met_targets_let_it_grow(clock: FakeClock) -> None:
    params = AdaptiveRoom(slo_min_samples=10, slo_window_s=5.0)
    pool = _pool(Backend(url="http://e:1"), params)
    state = pool.all()[0]
    engine = SimEngine(64)
    _run(pool, engine, clock, 5.0, demand=500)
    grown = state.max_room
    assert grown > params.initial_room
    for _ in range(10):
        pool.observe_latency(state, clock(), False)  # the backend's part missed its target
    changes = _run(pool, engine, clock, 1.0, demand=500)
    assert [c.reason for c in changes] == ["slo"]
    shrunk = state.max_room
    assert shrunk < grown
    # Targets met again: growth resumes (additively now: no more slow start).
    for _ in range(10):
        pool.observe_latency(state, clock(), True)
    _run(pool, engine, clock, 3.0, demand=500)
    assert shrunk < state.max_room < shrunk * 2


def test_no_metrics_at_all_grows_on_latency_alone(clock: FakeClock) -> None:
    """A backend that is not vLLM (no /metrics): the room grows while it is used and the
    targets hold, up to the ceiling."""
    pool = _pool(Backend(url="http://e:1", max_inflight=40, adaptive=True))
    _run(pool, SimEngine(4), clock, 10.0, demand=500, scrape=False)
    assert pool.all()[0].max_room == 40


def test_fixed_max_inflight_never_moves_and_reload_keeps_a_learned_room(
    clock: FakeClock,
) -> None:
    pool = _pool(Backend(url="http://e:1", max_inflight=6))
    assert isinstance(pool.all()[0].room_controller, FixedRoom)
    assert _run(pool, SimEngine(64), clock, 20.0, demand=500) == []
    assert pool.all()[0].max_room == 6
    pool.reconfigure([Backend(url="http://e:1")], HEALTH)  # now adaptive
    state: BackendState = pool.all()[0]
    assert isinstance(state.room_controller, GradientRoom)
    _run(pool, SimEngine(16), clock, 30.0, demand=500)
    pool.reconfigure([Backend(url="http://e:1", name="renamed")], HEALTH)
    assert state.max_room == 18  # a reload that keeps it adaptive keeps what it learned
