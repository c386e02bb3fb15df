"""How many requests a backend may hold at once (its room), learned or fixed (docs/slo.md).

The controller is told, once per monitor pass, what the backend looks like (vLLM's scraped
queue, running batch, KV usage and preemptions; the most the proxy had in flight there since
the last pass) and, per finished request, whether the backend's part of its latency met its
tier's target. Like Netflix's concurrency-limits it changes the room on evidence only: after a
change it waits for a scrape taken after that change. The rule:

- vLLM queued beyond the allowance (plus a tenth of its batch) in every scrape since the last
  change: the room jumps down to what vLLM runs plus the allowance plus what is in transit,
  if that is less (vLLM's ``running`` is its real batch
  limit, whatever limits it; the most it ran over the last ``_PEAK_WINDOW_S``, since one scrape
  may fall between a request's end and the next one's start);
- vLLM ran its whole batch in each of at least four scrapes since the last change and held
  more than the allowance (plus the slack) waiting on average, its queue swinging between
  full and nearly empty in step with the scrapes (requests of one length end together): the
  room shrinks by half that average excess, never under the batch plus the allowance;
- vLLM preempts with its KV cache nearly full (KV pressure; the plugin's preemptions for a
  better tier come with KV to spare and do not count) or the tiers' targets slip: the room
  shrinks by ``decrease_ratio``;
- vLLM ran nearly all the room at once (more than the room less the allowance, counting what
  is in transit) and held no more than the allowance waiting on average since the last
  change, KV usage below ``kv_high``,
  targets met and the room was used: it grows, doubling until the first shrink (slow start),
  then by ``increase_ratio`` (after a shrink for the SLO, only once a full window of requests
  judged the new room);
- anything else, or stale metrics from a backend that had them: the room stays as it is.

In transit: the proxy's requests that vLLM's scheduler does not hold (in flight at the proxy
less vLLM's running and waiting, smoothed over the scrapes of about 5 s): taken in by its API
server but not yet scheduled, or done but still streaming out. They hold the proxy's room,
not a place in vLLM's batch; on a busy API server (a CPU engine shares its core with the
model) they are tens of requests, and a room that leaves them out keeps vLLM's batch short.

A room at vLLM's batch limit plus the allowance plus the transit keeps the allowance in vLLM's
queue: vLLM runs no more than the room less the allowance and the transit (no growth) and holds
no more than the allowance waiting (no shrink), so the room holds still under constant load.
Every decision rests on at least two scrapes taken since the last change.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from proxy.config.slo import AdaptiveRoom

if TYPE_CHECKING:
    from proxy.config.backends import Backend
    from proxy.policies.types import ScrapedLoad

# vLLM's batch limit is the most it ran over this long (scrapes are snapshots).
_PEAK_WINDOW_S = 5.0
# Scrapes a swinging queue needs before its average shrinks the room (2 s at 0.5 s a scrape).
_SWING_SCRAPES = 4
# Hysteresis of the queued rule, as a share of vLLM's batch (at least 1 request).
_SLACK_SHARE = 0.1
# Weight of each new scrape in the smoothed transit (about the last 10 scrapes, 5 s).
_TRANSIT_SMOOTHING = 0.1
# Preemptions count as KV pressure when KV usage is at least kv_high less this.
_KV_MARGIN = 0.1


class _Scrape(NamedTuple):
    at: float
    running: float
    waiting: float


@dataclass(frozen=True, slots=True)
class _Window:
    """The scrapes since the last change, summed up (``GradientRoom._window``)."""

    peak_running: float
    least_waiting: float
    mean_waiting: float
    slack: float  # how far past the allowance vLLM may queue before the room shrinks


@dataclass(frozen=True, slots=True)
class RoomSignals:
    load: ScrapedLoad | None  # the latest scrape, None if stale or never seen
    had_metrics: bool  # the backend has answered /metrics at least once
    peak_inflight: int  # the most the proxy had in flight there since the last pass
    transit: float  # in flight there but not held by vLLM's scheduler, at the latest scrape
    allowance: float  # requests vLLM may hold waiting without it being a signal


@dataclass(frozen=True, slots=True)
class RoomChange:
    old: float
    new: float
    reason: str  # grow | queued | preempted | slo


class RoomController(Protocol):
    def limit(self) -> float:
        """The room now: requests this backend may hold at once (at least 1)."""

    def tick(self, now: float, signals: RoomSignals) -> RoomChange | None:
        """Look at the backend once more; the change made, if any."""

    def observe(self, now: float, met: bool) -> None:
        """A request on this backend ended: whether its backend-side latency met its tier's
        target (only requests of tiers with an SLO are told)."""

    def set_ceiling(self, ceiling: float) -> None:
        """A reload changed the most this room may be."""


class FixedRoom:
    """Today's hand-set ``max_inflight``."""

    def __init__(self, size: int) -> None:
        self.size = float(size)

    def limit(self) -> float:
        return self.size

    def tick(self, now: float, signals: RoomSignals) -> RoomChange | None:
        return None

    def observe(self, now: float, met: bool) -> None:
        pass

    def set_ceiling(self, ceiling: float) -> None:
        self.size = ceiling


class SloWindow:
    """Whether the recent requests met their targets: misses over the last ``window_s``."""

    def __init__(self, window_s: float, min_samples: int) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._seen: deque[tuple[float, bool]] = deque()
        self._misses = 0

    def add(self, now: float, met: bool) -> None:
        self._seen.append((now, met))
        self._misses += not met
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._seen and now - self._seen[0][0] > self.window_s:
            _, met = self._seen.popleft()
            self._misses -= not met

    def miss_share(self, now: float) -> float | None:
        """Share of misses, None with too few samples to judge."""
        self._trim(now)
        if len(self._seen) < self.min_samples:
            return None
        return self._misses / len(self._seen)

    def clear(self) -> None:
        self._seen.clear()
        self._misses = 0


class GradientRoom:
    """The adaptive room (see the module's docstring for the rule)."""

    def __init__(self, params: AdaptiveRoom, ceiling: float, miss_budget: float = 0.01) -> None:
        self.params = params
        self.ceiling = ceiling
        # Share of a window's requests allowed to miss (1 - the tightest SLO percentile).
        self.miss_budget = miss_budget
        self.room = float(min(params.initial_room, ceiling))
        self.slow_start = True
        self.changed_at = -math.inf
        self._preemptions: float | None = None
        self._preempted = False  # seen since the last change (a cooldown must not lose it)
        # The scrapes since the last change, over the last _PEAK_WINDOW_S
        self._scrapes: deque[_Scrape] = deque()
        # Requests in transit, smoothed over every scrape (changes of room do not reset it:
        # two scrapes after a change are too few to judge a quantity that moves this much).
        self.transit = 0.0
        self._last_scrape_at = -math.inf
        self._slo_bound = False  # the last decrease was for the SLO: grow on a judged window
        self.slo = SloWindow(params.slo_window_s, params.slo_min_samples)

    def limit(self) -> float:
        return self.room

    def set_ceiling(self, ceiling: float) -> None:
        self.ceiling = ceiling
        self.room = min(self.room, ceiling)

    def observe(self, now: float, met: bool) -> None:
        self.slo.add(now, met)

    def tick(self, now: float, signals: RoomSignals) -> RoomChange | None:
        load = signals.load
        if signals.had_metrics and load is None:
            return None  # stale: keep the last good room
        self._preempted |= self._new_preemptions(load)
        self._record(load, signals.transit)
        if now - self.changed_at < self.params.adjust_every_s:
            return None
        if load is not None and len(self._scrapes) < 2:
            return None  # two scrapes since the last change, at least: one may fall between steps
        window = self._window()
        misses = self.slo.miss_share(now)
        decided, change = self._shrink(now, load, signals, window)
        if not decided:
            decided, change = self._answer_trouble(now, misses)
        return change if decided else self._grow(now, load, signals, window)

    def _window(self) -> _Window:
        """Over the scrapes since the last change, not one snapshot: that may catch vLLM
        between steps (successors of finished requests not yet scheduled) or the transit at
        a peak. Shrinking needs every scrape queued beyond the allowance, growth an average
        queue within it."""
        peak_running = max((s.running for s in self._scrapes), default=0.0)
        waits = [s.waiting for s in self._scrapes]
        return _Window(
            peak_running=peak_running,
            least_waiting=min(waits, default=0.0),
            mean_waiting=sum(waits) / max(1, len(waits)),
            # Hysteresis against the noise of snapshots: vLLM may queue a tenth of its batch
            # more than the allowance before the room shrinks (one request at least).
            slack=max(1.0, _SLACK_SHARE * peak_running),
        )

    def _shrink(
        self, now: float, load: ScrapedLoad | None, signals: RoomSignals, w: _Window
    ) -> tuple[bool, RoomChange | None]:
        """To what vLLM runs, when it queues beyond the allowance; (False, None): it does not."""
        if load is None:
            return False, None
        # self.transit: what the room must cover besides vLLM's batch and queue.
        if w.least_waiting > signals.allowance + w.slack - 1:
            batch = math.ceil(w.peak_running + signals.allowance + self.transit)
            if batch < self.room:
                return True, self._set(now, batch, "queued")
        if self._swinging_over(w.mean_waiting, w.peak_running, signals, w.slack):
            # Half the average excess at a time, never under the batch plus the allowance.
            floor = math.ceil(w.peak_running + signals.allowance)
            step = self.room - (w.mean_waiting - signals.allowance) / 2
            if max(floor, step) < self.room:
                return True, self._set(now, max(floor, step), "queued")
        return False, None

    def _answer_trouble(self, now: float, misses: float | None) -> tuple[bool, RoomChange | None]:
        """Smaller after a preemption or an SLO slipping; held while an SLO-bound room has not
        been judged again; (False, None): none of these."""
        decrease = self.params.decrease_ratio
        if self._preempted:
            return True, self._set(now, self.room * decrease, "preempted")
        if misses is not None and misses > self.miss_budget:
            self.slo.clear()  # judge the next room on its own requests
            self._slo_bound = True
            return True, self._set(now, self.room * decrease, "slo")
        if self._slo_bound and misses is None:
            return True, None
        self._slo_bound = False
        return False, None

    def _grow(
        self, now: float, load: ScrapedLoad | None, signals: RoomSignals, w: _Window
    ) -> RoomChange | None:
        """vLLM ran (nearly) all the room at once (all of it that was not in transit): its
        batch has space left. A room at vLLM's batch plus the allowance plus the transit
        keeps the allowance waiting there and stops growing."""
        p = self.params
        below_batch = load is None or self._batch_has_space(signals, w)
        kv_ok = load is None or load.kv_usage < p.kv_high
        used = signals.peak_inflight >= self.room - 1
        if below_batch and kv_ok and used and self.room < self.ceiling:
            grown = self.room * 2 if self.slow_start else self.room * (1 + p.increase_ratio)
            return self._set(now, max(grown, self.room + 1), "grow")
        return None

    def _batch_has_space(self, signals: RoomSignals, w: _Window) -> bool:
        # One request of slack (the slack of shrinking applies to shrinking only: growth
        # must still find a batch limit it has not seen).
        ran = w.peak_running + self.transit
        return w.mean_waiting <= signals.allowance and ran > self.room - signals.allowance + 1

    def _swinging_over(
        self, mean_waiting: float, peak_running: float, signals: RoomSignals, slack: float
    ) -> bool:
        """vLLM's queue swings in step with the scrapes (requests of one length end together:
        full in one scrape, its successors still in vLLM's API server in the next), so "queued
        in every scrape" never holds; yet vLLM ran its whole batch in every scrape and held more
        than the allowance on average, over at least _SWING_SCRAPES scrapes: the room is too
        big by about the average excess (taken by halves: one scrape short of the batch, as on
        a busy API server's noisy transit, stops it)."""
        seen = self._scrapes
        if len(seen) < _SWING_SCRAPES or mean_waiting <= signals.allowance + slack:
            return False
        return all(s.running >= peak_running for s in seen)

    def _record(self, load: ScrapedLoad | None, transit: float) -> None:
        """Take in a new scrape once: into the smoothed transit always, into the window only
        if taken after the last change."""
        seen = self._scrapes
        if load is not None and load.at > self._last_scrape_at:
            self._last_scrape_at = load.at
            self.transit += _TRANSIT_SMOOTHING * (transit - self.transit)
            if load.at > self.changed_at:
                seen.append(_Scrape(load.at, load.running, load.waiting))
        while seen and seen[-1].at - seen[0].at > _PEAK_WINDOW_S:
            seen.popleft()

    def _new_preemptions(self, load: ScrapedLoad | None) -> bool:
        """vLLM preempted for want of KV cache since the last scrape. Preemptions with KV
        cache to spare are the plugin's, for a waiting better tier (docs/plugin.md): no sign
        of too large a room."""
        if load is None or load.preemptions is None:
            return False
        before, self._preemptions = self._preemptions, load.preemptions
        kv_short = load.kv_usage >= self.params.kv_high - _KV_MARGIN
        return before is not None and load.preemptions > before and kv_short

    def _set(self, now: float, room: float, reason: str) -> RoomChange | None:
        new = float(max(self.params.min_room, min(self.ceiling, math.floor(room))))
        if reason != "grow":
            self.slow_start = False
            self._preempted = False  # this decrease answers it
        if new == self.room:
            return None
        old, self.room, self.changed_at = self.room, new, now
        self._scrapes.clear()  # the batch seen under the old room says little of the new one
        return RoomChange(old, new, reason)


def room_controller(cfg: Backend, adaptive: AdaptiveRoom, miss_budget: float) -> RoomController:
    """A backend's room: fixed at its ``max_inflight``, or learned up to its ceiling."""
    if not cfg.adaptive_room:
        return FixedRoom(cfg.max_inflight or adaptive.initial_room)
    return GradientRoom(adaptive, adaptive.ceiling(cfg.max_inflight), miss_budget)
