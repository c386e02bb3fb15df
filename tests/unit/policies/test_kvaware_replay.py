"""``KvAware.pick`` as scoring terms makes the same decisions as the one function it was: a few
hundred random states replayed through both choosers in lockstep, the old function copied here
as the reference (main at 3153c1d, ``proxy/policies/kvaware.py``), with issue 32's home bonus
in proportion to the share of the prompt the home holds, its spread rule (the choosers are
built with ``max_share`` 1.0 here: no backend is ever past it, as in the old pick) and its new
placement (a prompt no backend holds half of has no home)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from proxy.bench.kvviews import IndexedBackend
from proxy.config.backends import Backend
from proxy.policies.backends import TIE, B, Candidate, free_share, slot_share
from proxy.policies.kvaware import KvAware
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import QueuedRequest, ScrapedLoad
from tests.helpers.clock import FakeClock

BLOCK = 16
WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=4.0, worst=0.25)
# Three shared prefixes (a tenant's system prompt), each under a few conversations.
PREFIXES = [tuple(range(1000 * p, 1000 * p + 4)) for p in range(3)]


FakeBackend = IndexedBackend


# The reference: KvAware.pick before the terms, verbatim (a method of KvAware, below).
def old_pick(
    self: KvAware,
    candidates: Sequence[Candidate[B]],
    request: QueuedRequest | None,
    *,
    now: float | None = None,
    full: Sequence[B] = (),
) -> B | None:
    now = self.clock() if now is None else now
    blocks = request.prompt_blocks if request is not None else None
    weight = self.latency_weights.get(request.tier, 1.0) if request is not None else 1.0
    prompt = max(1, request.prompt_tokens) if request is not None else 1
    if blocks:  # the prompt's real length: its full blocks and a partial one
        prompt = (len(blocks) + 1) * self.block_size
    self._expire(now)
    home, home_run = self.memory.home(blocks) if blocks else (None, 0)
    # A new branch of a shared prefix (a tenant's new conversation) goes to the prefix's
    # home. It loses only that prefix if it starts elsewhere: off a home that took more
    # than its share, it may (one prefix moved per balance_s: the shares lag the move).
    group = self._groups.home(blocks[home_run - 1]) if blocks and home_run else None
    branch = group is not None
    home = group or home
    # Since issue 32's new placement: a prompt that no backend holds half of (cached there, or
    # sent to its home) has no home and counts nothing cached.
    cached = [self.cached_tokens(c.state, blocks) if blocks else 0 for c in candidates]
    placed_as_new = request is not None and max(*cached, home_run * self.block_size, 0) < prompt / 2
    if placed_as_new:
        home, home_run = None, 0
    for c in candidates:
        self._rooms[c.state.cfg.url] = c.state.max_room
    shares = self._filled.shares()
    over = self._over_share(shares)
    # Busier in slots, not in cache fill (since issue 32: a home's cache full of its prefixes
    # moved them off it).
    roomiest = max((slot_share(c) for c in candidates), default=0.0)
    may_move = branch and self.clock() - self._rehomed_at >= self.balance_s
    best: B | None = None
    best_key = (0, 0, 0, 0, 0)
    best_saved = 0
    for c in candidates:
        url = c.state.cfg.url
        share = shares.get(url, 0.0)
        saved = 0 if placed_as_new or not blocks else self.cached_tokens(c.state, blocks)
        best_saved = max(best_saved, saved)
        room = free_share(c)
        # Taking more than its share lately, and busier than another now.
        if may_move and url in over and slot_share(c) < roomiest - TIE:
            saved = 0
        elif home is not None and url == home:
            # In proportion to the share of the prompt the home holds (since issue 32).
            cover = min(1.0, home_run * self.block_size / prompt)
            room += self.home_slots * cover / max(1.0, c.state.max_room)
        score = min(1.0, saved / prompt) + weight * room
        age = self._rotation.age(c.state)
        key = (round(score / TIE), round(room / TIE), saved, round(-share / TIE), age)
        if best is None or key > best_key:
            best, best_key = c.state, key
    # Wait only for a home that serves the request and is up (not ejected, not draining):
    # one of ``full``; a home that is neither is no home to wait for.
    waitable = home is not None and any(b.cfg.url == home for b in full)
    gain = (home_run * self.block_size - best_saved) / prompt
    stays = not (may_move and home in over)  # else the balance rule lets it start elsewhere
    if (
        waitable
        and stays
        and home
        and request is not None
        and self._holds(request, home, gain, now)
    ):
        return None  # its home is full: wait for it there (the dispatcher looks again)
    return best


class OldKvAware(KvAware):
    pick = old_pick


def _prompt(rng: random.Random) -> tuple[int, ...] | None:
    if rng.random() < 0.1:
        return None  # nothing known of its blocks
    prefix = rng.choice(PREFIXES)
    conversation = rng.randrange(4)
    turns = rng.randrange(4)
    return prefix + tuple(100_000 + 1000 * prefix[0] + 100 * conversation + t for t in range(turns))


def _request(rng: random.Random, now: float) -> QueuedRequest:
    tier = rng.choice(["high", "normal", "low"])
    blocks = _prompt(rng)
    size = rng.randrange(1, 200) if rng.random() < 0.2 else BLOCK * len(blocks or ()) + 5
    arrival = now - rng.uniform(0.0, 2.0)
    req = QueuedRequest(tier, "t", size, 16, arrival, deadline_s=arrival + rng.uniform(1.0, 8.0))
    req.prompt_blocks = blocks
    return req


def _candidates(
    backends: list[FakeBackend], rng: random.Random, now: float
) -> tuple[list[Candidate[FakeBackend]], list[FakeBackend]]:
    candidates, full = [], []
    for b in backends:
        room = b.max_room - b.inflight
        load = ScrapedLoad(0, b.inflight, rng.random(), now) if rng.random() < 0.5 else None
        if room >= 1:
            candidates.append(Candidate(b, room, load))
        else:
            full.append(b)
    return candidates, full


@pytest.mark.parametrize("seed", range(6))
def test_the_scoring_terms_pick_as_the_old_pick_did(seed: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    knobs = dict(block_size=BLOCK, latency_weights=WEIGHTS, hold_s=rng.choice([0.0, 2.0, 5.0]))
    knobs |= dict(balance_s=5.0, balance_min=4.0, pending_s=3.0, max_share=1.0, clock=clock)
    # The cost model of work queued ahead is off: the old pick had none.
    new = KvAware(**knobs, work_weight=0.0)  # type: ignore[arg-type]
    old = OldKvAware(**knobs)  # type: ignore[arg-type]
    backends = [
        FakeBackend(Backend(url=f"http://b{i}:80"), room_cap=rng.choice([2.0, 4.0, 8.0]))
        for i in range(rng.randrange(2, 5))
    ]
    waiting: list[QueuedRequest] = []
    held = moved = 0
    for _ in range(300):
        clock.advance(rng.uniform(0.0, 0.8))
        for b in backends:  # some finish, the indexes catch up or go cold
            b.inflight = max(0, min(int(b.max_room), b.inflight + rng.choice([-2, -1, 0, 1, 1])))
            if rng.random() < 0.05:
                b.cached = None if rng.random() < 0.3 else set()
            elif rng.random() < 0.3 and b.cached is not None:
                b.cached |= set(rng.choice(PREFIXES)[: rng.randrange(1, 5)])
        req = waiting.pop(0) if waiting and rng.random() < 0.5 else _request(rng, clock())
        candidates, full = _candidates(backends, rng, clock())
        now = clock() if rng.random() < 0.5 else None
        picked = new.pick(candidates, req, now=now, full=full)
        assert picked is old.pick(candidates, req, now=now, full=full)
        if picked is None:
            held += bool(candidates)
            if rng.random() < 0.2:
                new.left(req)
                old.left(req)
            else:
                waiting.append(req)
            continue
        moved += picked.cfg.url != new.memory.home(req.prompt_blocks or ())[0]
        new.served(picked, req)
        old.served(picked, req)
        picked.inflight += 1
    assert moved > 0  # the replay reached more than one backend's cache
    if new.holds["low"] > 0:
        assert held > 0  # and the hold rule
