"""Quotas global across replicas: one counter key per tenant, counter and period in Redis
(``{prefix}:v2:quota:{tenant}:tokens_per_day:2026-12-01``), reserved and corrected by Lua scripts
(``proxy.replicas.quota_scripts``), so a reservation is atomic across replicas. Each key expires a
day after its period ends: a request admitted before the boundary still settles into it.

Every write carries an id that Redis records: a write sent again (its answer lost: a stall past
``call_timeout_s``) changes nothing, and a reservation whose answer was lost is undone by that
id once Redis answers again — or, when it never arrived, charges nothing if it comes late. The
counters then agree with what was used, whatever the stall.

Redis down follows ``shared_state.on_failure`` as the limits do: ``refuse`` answers 503;
``local`` decides with this process's ledger, which starts from the counters as Redis last
gave them (not from zero: a tenant does not get a fresh day's quota per replica because Redis
is away), and what it charges meanwhile is added to Redis once it answers again. A counter that
holds something other than a number is the same for its tenant alone: that tenant is decided
as ``on_failure`` says (never a fresh period from a reset), every other tenant goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.api.errors import shared_state_unavailable
from proxy.api.quota_counters import COUNTERS
from proxy.replicas.client import (
    Script,
    SharedStateBadValue,
    SharedStateDown,
    SharedStore,
    may_have_run,
)
from proxy.replicas.quota_scripts import APPLY, RESERVE, UNDO
from proxy.scheduling.quotas import (
    QuotaAsk,
    QuotaHold,
    QuotaLedger,
    QuotaVerdict,
    decide,
    period,
)

log = logging.getLogger("tierproxy.replicas")

GRACE_S = 86400.0  # a key outlives its period by this much
# A write's record in the tenant's ledger lives this long: a write sent again within it changes
# nothing (ours are sent again within seconds of Redis answering again).
RECORD_TTL_S = 3600.0
# How long a stopping replica waits for Redis to take its last writes: this many call
# timeouts, at least STOP_GRACE_MIN_S (a shutdown must end even with Redis gone).
STOP_GRACE_CALLS = 8
STOP_GRACE_MIN_S = 2.0

Periods = tuple[tuple[str, str], ...]  # (counter, period name)


@dataclass(frozen=True)
class _Write:
    """A write to one tenant's counters whose answer is still owed: sent again, by the same id,
    until Redis answers it."""

    script: Script
    tenant: str
    op: str
    periods: Periods
    amounts: tuple[float, ...]
    mode: tuple[str, ...] = ()  # APPLY's 'settle' | 'add'


class SharedQuotaBook:
    """``proxy.scheduling.quotas.QuotaBook`` over Redis, with a local ledger as the fallback."""

    def __init__(
        self,
        store: SharedStore,
        local: QuotaLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.local = local if local is not None else QuotaLedger()
        self.clock = clock  # the ledger's records expire by it (Unix seconds)
        self._replica = uuid.uuid4().hex[:12]
        self._ops = itertools.count(1)
        # Charged locally while Redis was away, to add there once it answers:
        # (tenant, counter, period) -> amount.
        self._pending: dict[tuple[str, str, str], float] = {}
        self._retry_due = False  # a retry of the unanswered writes is sleeping (_catch_up_later)
        # Writes whose answer was lost (reservations to undo, corrections to apply), by id.
        self._unanswered: dict[str, _Write] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        store.on_up.append(self._catch_up)

    async def stop(self) -> None:
        """The last writes sent before the store closes (in flight, sleeping, owed or
        unanswered), for a grace (``STOP_GRACE_CALLS``); what Redis never took is logged. The
        writes a sleeping retry started were not awaited (red team F8: +314 and +424)."""
        cfg = self.store.cfg
        grace = max(STOP_GRACE_MIN_S, STOP_GRACE_CALLS * cfg.call_timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        tried = False
        while (left := deadline - loop.time()) > 0:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=left)
            elif not self._owed_now() or (self.store.up and tried):
                break  # all taken, or what stays owed is a bad key's (until it is fixed)
            elif self.store.up:
                self._catch_up()
                tried = True
            else:  # down: its probe may bring it back (on_up sends them)
                await asyncio.sleep(min(cfg.probe_interval_s, left))
        for task in self._tasks:
            task.cancel()
        if self._owed_now():
            log.warning(
                "shared quotas: stopped with %d writes unanswered and %d corrections owed to"
                " Redis (it did not answer within %.1f s): those tenants' counters stay off by"
                " them",
                len(self._unanswered),
                len(self._pending),
                grace,
            )

    def owed(self, tenant: str, counter: str, name: str) -> float:
        """What this replica charged on a counter that Redis has not taken yet."""
        return self._pending.get((tenant, counter, name), 0.0)

    def _owed_now(self) -> bool:
        return bool(self._unanswered or self._pending)

    def key(self, tenant: str, counter: str, name: str) -> str:
        # One hash tag per tenant: a Redis Cluster keeps a tenant's keys on one slot.
        return self.store.key("quota", "{" + tenant + "}", counter, name)

    def _keys(self, tenant: str, periods: Periods) -> list[str]:
        ledger = self.store.key("quota", "{" + tenant + "}", "ops")
        return [ledger, f"{ledger}:due", *(self.key(tenant, c, n) for c, n in periods)]

    def _mint(self) -> str:
        return f"{self._replica}:{next(self._ops):x}"

    def _head(self, op: str) -> list[object]:
        return [op, int(self.clock() * 1000), int(RECORD_TTL_S * 1000)]

    async def reserve(self, ask: QuotaAsk, wall: float) -> QuotaVerdict:
        if not ask.limits:
            return decide(ask, {}, wall)
        if self.store.up:
            verdict = await self._reserve_shared(ask, wall)
            if verdict is not None:
                return verdict
        if self.store.cfg.on_failure == "refuse":
            raise shared_state_unavailable(self.store.cfg.probe_interval_s)
        verdict = self.local.try_reserve(ask, wall)
        if verdict.hold is not None:
            for counter, name in verdict.hold.periods:
                self._owe(ask.tenant, counter, name, ask.amount(counter))
        return verdict

    async def _reserve_shared(self, ask: QuotaAsk, wall: float) -> QuotaVerdict | None:
        """Redis's verdict, or None: decided without Redis (down, busy, or this tenant's
        counter unreadable)."""
        counters = list(ask.limits)
        periods = tuple((c, period(COUNTERS[c].span, wall)[0]) for c in counters)
        amounts = tuple(ask.amount(c) for c in counters)
        op = self._mint()
        args: list[object] = self._head(op)
        for (counter, name), amount in zip(periods, amounts, strict=True):
            args += [ask.limits[counter], amount, _expiry_ms(_period_end(counter, name))]
        # It may have run though its answer was lost (a stall past the call timeout): undone
        # by its id once Redis answers; if it has not run yet, the undo makes it charge
        # nothing when it does. So too when its client left and the call then failed.
        undo = _Write(UNDO, ask.tenant, op, periods, amounts)
        try:
            answer = await self.store.run_or_undo(
                RESERVE,
                self._keys(ask.tenant, periods),
                args,
                lambda answer: self._give_back(ask, periods, op, answer),
                lost=lambda: self._unanswer(undo),
            )
        except SharedStateDown as failure:
            if may_have_run(failure):  # not "no connection free": never sent, nothing to undo
                self._unanswer(undo)
            return None
        status = self._read_status(answer, "quota")
        if self._pending or self._unanswered:
            self._catch_up()
        if status < 0:
            return None  # this tenant's counter is unreadable (-1); -2 cannot come of a new id
        values = [float(_text(v)) for v in answer[3:]]
        for (counter, name), value in zip(periods, values, strict=True):
            self.local.put(ask.tenant, counter, name, value)
        if status == 1:
            hold = QuotaHold(ask.tenant, periods, ask.tokens, ask.cost, shared=True, op=op)
            return QuotaVerdict(True, hold)
        verdict = decide(ask, dict(zip(counters, values, strict=True)), wall)
        if not verdict.allowed:
            return verdict
        # Redis refused what its figures, read back, would allow (a float's last bit):
        # Redis decides.
        first, resets_at = counters[0], period(COUNTERS[counters[0]].span, wall)[1]
        limit, asked = ask.limits[first], ask.amount(first)
        return QuotaVerdict(False, None, first, limit, values[0], asked, resets_at - wall)

    def _read_status(self, answer: list[Any], kind: str) -> int:
        """The answer's status; a bad counter or a reset ledger counted and logged."""
        status, bad, reset = int(answer[0]), _text(answer[1]), _text(answer[2])
        if bad:
            action = (
                "its tenant is decided without Redis until the key is fixed or deleted"
                " (resetting it would give the tenant a fresh period)"
            )
            self.store.bad_key(kind, bad, action)
        for key in filter(None, reset.split("\n")):
            self.store.bad_key("ledger", key, "reset (only the records of writes were in it)")
        return status

    def settle(self, hold: QuotaHold, tokens: float | None, cost: float | None) -> None:
        deltas = [(c, n, hold.delta(c, tokens, cost)) for c, n in hold.periods]
        for counter, name, delta in deltas:
            if delta:
                self.local.add(hold.tenant, counter, name, delta)
        if not any(d for *_, d in deltas):
            return  # the record of an exact reservation expires by itself
        if not hold.shared or not self.store.up:
            for counter, name, delta in deltas:  # never sent: owed, as a charge of its own
                self._owe(hold.tenant, counter, name, delta)
            return
        amounts = tuple(d for *_, d in deltas)
        self._send(_Write(APPLY, hold.tenant, hold.op, hold.periods, amounts, ("settle",)))

    def _give_back(self, ask: QuotaAsk, periods: Periods, op: str, answer: list[Any]) -> None:
        """Reserved, but its caller left meanwhile (the client went): the worst case goes back."""
        if int(answer[0]) == 1:
            hold = QuotaHold(ask.tenant, periods, ask.tokens, ask.cost, shared=True, op=op)
            self.settle(hold, 0, 0)

    def usage(self, tenant: str, limits: Mapping[str, float], wall: float) -> dict[str, Any]:
        """As this replica last saw the counters: each reservation reads them back from Redis,
        and this replica's own corrections are added as it makes them."""
        return self.local.usage(tenant, limits, wall)

    # -- Redis writes ------------------------------------------------------------------------
    def _owe(
        self, tenant: str, counter: str, name: str, amount: float, *, soon: bool = True
    ) -> None:
        """Charged without Redis, to add there when it answers. ``soon``: if it counts as up
        now (the charge was decided while it was away, or it had no connection free), after a
        probe interval: a quiet replica's last correction otherwise waited for a reservation
        that might never come, its tenant over-counted on every replica meanwhile."""
        key = (tenant, counter, name)
        self._pending[key] = self._pending.get(key, 0.0) + amount
        if soon:
            self._retry_soon()

    def _catch_up(self) -> None:
        """Redis answers: the lost answers' writes again (same ids), then what was owed."""
        unanswered, self._unanswered = self._unanswered, {}
        for write in unanswered.values():
            self._send(write)
        pending, self._pending = self._pending, {}
        # One write per tenant: a Redis Cluster runs a script on one slot only.
        for tenant in dict.fromkeys(t for t, _, _ in pending):
            mine = [(c, n, a) for (t, c, n), a in pending.items() if t == tenant]
            periods = tuple((c, n) for c, n, _ in mine)
            amounts = tuple(a for *_, a in mine)
            self._send(_Write(APPLY, tenant, self._mint(), periods, amounts, ("add",)))

    def _send(self, write: _Write) -> None:
        self._spawn(self._write(write))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, write: _Write) -> None:
        args: list[object] = [*self._head(write.op), *write.mode]
        for (counter, name), amount in zip(write.periods, write.amounts, strict=True):
            args += [amount, _expiry_ms(_period_end(counter, name))]
        try:
            answer = await self.store.run(
                write.script, self._keys(write.tenant, write.periods), args
            )
        except SharedStateBadValue:
            # Redis answered: the script stopped at a value it cannot read, before writing
            # (the counters are checked first). Sent again by its id, it would only stop there
            # again, every probe interval (red team F1: a counter that went on growing).
            self._not_written(write)
            return
        except SharedStateDown:
            self._unanswer(write)
            return
        if self._read_status(answer, "quota") < 0:
            self._not_written(write)

    def _not_written(self, write: _Write) -> None:
        """Nothing written (a bad counter): a charge or correction owed until the key is fixed
        (the tokens were used all the same); an undo has nothing to take back there."""
        if write.script is UNDO:
            return
        for (counter, name), amount in zip(write.periods, write.amounts, strict=True):
            self._owe(write.tenant, counter, name, amount, soon=False)

    def _unanswer(self, write: _Write) -> None:
        """A write whose answer was lost: sent again (same id, applied once) when Redis
        answers: on its return if it is marked down, else after a probe interval."""
        self._unanswered[write.op] = write
        self._retry_soon()

    def _retry_soon(self) -> None:
        """The unanswered and owed writes sent after a probe interval, if Redis counts as up
        (down, they go when it answers again: ``on_up``); one retry pending at most."""
        if self.store.up and not self._retry_due:
            self._retry_due = True
            self._spawn(self._catch_up_later())

    async def _catch_up_later(self) -> None:
        """Writes unanswered, or charges owed, while Redis still counts as up, sent a probe
        interval later: they waited for this replica's next reservation, which at a quiet
        replica's last request never came (the reconciliation: counters 214, 345 over the log)."""
        await asyncio.sleep(self.store.cfg.probe_interval_s)
        self._retry_due = False
        if self.store.up and (self._unanswered or self._pending):
            self._catch_up()


def _period_end(counter: str, name: str) -> float:
    """The end of the period named ``name`` ("2026-12-01", "2026-12")."""
    span = COUNTERS[counter].span
    start = name if span == "day" else f"{name}-01"
    return period(span, datetime.fromisoformat(start + "T00:00:00+00:00").timestamp())[1]


def _expiry_ms(resets_at: float) -> int:
    return int((resets_at + GRACE_S) * 1000)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
