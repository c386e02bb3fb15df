"""Quotas global across replicas: one counter key per tenant, counter and period in Redis
(``{prefix}:quota:{tenant}:tokens_per_day:2026-12-01``), reserved and corrected by Lua scripts,
so a reservation is atomic across replicas. Each key expires a day after its period ends: a
request admitted before the boundary still settles into it.

Redis down follows ``shared_state.on_failure`` as the limits do: ``refuse`` answers 503;
``local`` decides with this process's ledger, which starts from the counters as Redis last
gave them (not from zero: a tenant does not get a fresh day's quota per replica because Redis
is away), and what it charges meanwhile is added to Redis once it answers again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from datetime import datetime
from typing import Any

from proxy.api.errors import shared_state_unavailable
from proxy.scheduling.quotas import (
    COUNTERS,
    QuotaAsk,
    QuotaHold,
    QuotaLedger,
    QuotaVerdict,
    decide,
    period,
)
from proxy.shared.client import Script, SharedStateDown, SharedStore

GRACE_S = 86400.0  # a key outlives its period by this much

# KEYS: the counters; ARGV: per key, its limit, the amount asked and its expiry (Unix ms).
# All or nothing: {1, used after, ...} when every counter stays within its limit, else
# {0, used now, ...} and nothing is charged.
RESERVE = Script(
    """
local used = {}
local ok = 1
for i, key in ipairs(KEYS) do
  used[i] = tonumber(redis.call('GET', key) or '0')
  local limit, amount = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
  if amount > 0 and used[i] + amount > limit then ok = 0 end
end
local out = {ok}
for i, key in ipairs(KEYS) do
  if ok == 1 then
    used[i] = tonumber(redis.call('INCRBYFLOAT', key, ARGV[3 * i - 1]))
    redis.call('PEXPIREAT', key, ARGV[3 * i])
  end
  out[#out + 1] = tostring(used[i])
end
return out
"""
)

# KEYS: the counters; ARGV: per key, the amount to add and its expiry (Unix ms). A correction
# that would lower a key that is gone (expired, or a Redis that lost its data) is dropped.
ADD = Script(
    """
for i, key in ipairs(KEYS) do
  local amount = tonumber(ARGV[2 * i - 1])
  if amount >= 0 or redis.call('EXISTS', key) == 1 then
    redis.call('INCRBYFLOAT', key, ARGV[2 * i - 1])
    redis.call('PEXPIREAT', key, ARGV[2 * i])
  end
end
return #KEYS
"""
)


class SharedQuotaBook:
    """``proxy.scheduling.quotas.QuotaBook`` over Redis, with a local ledger as the fallback."""

    def __init__(self, store: SharedStore, local: QuotaLedger | None = None) -> None:
        self.store = store
        self.local = local if local is not None else QuotaLedger()
        # Charged locally while Redis was away, to add there once it answers:
        # (tenant, counter, period) -> amount.
        self._pending: dict[tuple[str, str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        store.on_up.append(self._push_pending)

    async def stop(self) -> None:
        if self._tasks:  # let the last corrections reach Redis (each bounded by its timeout)
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _key(self, tenant: str, counter: str, name: str) -> str:
        # One hash tag per tenant: a Redis Cluster keeps a tenant's keys on one slot.
        return self.store.key("quota", "{" + tenant + "}", counter, name)

    async def reserve(self, ask: QuotaAsk, wall: float) -> QuotaVerdict:
        if not ask.limits:
            return decide(ask, {}, wall)
        if self.store.up:
            counters = list(ask.limits)
            periods = tuple((c, period(COUNTERS[c][1], wall)[0]) for c in counters)
            keys = [self._key(ask.tenant, c, name) for c, name in periods]
            args: list[object] = []
            for counter, name in periods:
                args += [ask.limits[counter], ask.amount(counter)]
                args.append(_expiry_ms(_period_end(counter, name)))
            try:
                answer = await self.store.run_or_undo(
                    RESERVE, keys, args, lambda answer: self._give_back(ask, periods, answer)
                )
            except SharedStateDown:
                pass  # decided below, without Redis
            else:
                if self._pending:  # charged locally while Redis was away or busy
                    self._push_pending()
                values = [float(_text(v)) for v in answer[1:]]
                for (counter, name), value in zip(periods, values, strict=True):
                    self.local.put(ask.tenant, counter, name, value)
                if int(answer[0]) == 1:
                    hold = QuotaHold(ask.tenant, periods, ask.tokens, ask.cost, shared=True)
                    return QuotaVerdict(True, hold)
                verdict = decide(ask, dict(zip(counters, values, strict=True)), wall)
                if not verdict.allowed:
                    return verdict
                # Redis refused what its figures, read back, would allow (a float's last bit):
                # Redis decides.
                first, resets_at = counters[0], period(COUNTERS[counters[0]][1], wall)[1]
                limit, asked = ask.limits[first], ask.amount(first)
                return QuotaVerdict(False, None, first, limit, values[0], asked, resets_at - wall)
        if self.store.cfg.on_failure == "refuse":
            raise shared_state_unavailable(self.store.cfg.probe_interval_s)
        verdict = self.local.try_reserve(ask, wall)
        if verdict.hold is not None:
            for counter, name in verdict.hold.periods:
                self._owe(ask.tenant, counter, name, ask.amount(counter))
        return verdict

    def settle(self, hold: QuotaHold, tokens: float | None, cost: float | None) -> None:
        deltas = [(c, n, hold.delta(c, tokens, cost)) for c, n in hold.periods]
        deltas = [d for d in deltas if d[2]]
        for counter, name, delta in deltas:
            self.local.add(hold.tenant, counter, name, delta)
        if not deltas:
            return
        if not hold.shared or not self.store.up:
            for counter, name, delta in deltas:
                self._owe(hold.tenant, counter, name, delta)
            return
        items = [(hold.tenant, c, n, d) for c, n, d in deltas]
        self._spawn(self._add(items))

    def _give_back(
        self, ask: QuotaAsk, periods: tuple[tuple[str, str], ...], answer: list[Any]
    ) -> None:
        """Reserved, but its caller left meanwhile (the client went): the worst case goes back."""
        if int(answer[0]) == 1:
            self.settle(QuotaHold(ask.tenant, periods, ask.tokens, ask.cost, shared=True), 0, 0)

    def usage(self, tenant: str, limits: Mapping[str, float], wall: float) -> dict[str, Any]:
        """As this replica last saw the counters: each reservation reads them back from Redis,
        and this replica's own corrections are added as it makes them."""
        return self.local.usage(tenant, limits, wall)

    # -- Redis writes ------------------------------------------------------------------------
    def _owe(self, tenant: str, counter: str, name: str, amount: float) -> None:
        key = (tenant, counter, name)
        self._pending[key] = self._pending.get(key, 0.0) + amount

    def _push_pending(self) -> None:
        pending, self._pending = self._pending, {}
        if pending:
            self._spawn(self._add([(t, c, n, a) for (t, c, n), a in pending.items()]))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, items: list[tuple[str, str, str, float]]) -> None:
        # One script per tenant: a Redis Cluster runs a script on one slot only.
        for tenant in dict.fromkeys(t for t, *_ in items):
            mine = [item for item in items if item[0] == tenant]
            keys: list[str] = []
            args: list[object] = []
            for _, counter, name, amount in mine:
                keys.append(self._key(tenant, counter, name))
                args += [amount, _expiry_ms(_period_end(counter, name))]
            try:
                await self.store.run(ADD, keys, args)
            except SharedStateDown:
                # Kept for the next time Redis answers: the tokens were used all the same.
                for _, counter, name, amount in mine:
                    self._owe(tenant, counter, name, amount)


def _period_end(counter: str, name: str) -> float:
    """The end of the period named ``name`` ("2026-12-01", "2026-12")."""
    span = COUNTERS[counter][1]
    start = name if span == "day" else f"{name}-01"
    return period(span, datetime.fromisoformat(start + "T00:00:00+00:00").timestamp())[1]


def _expiry_ms(resets_at: float) -> int:
    return int((resets_at + GRACE_S) * 1000)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
