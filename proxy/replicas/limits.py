"""Tenant limits global across replicas: each decision is one Lua script in Redis
(``proxy.replicas.scripts``). When Redis cannot answer within ``call_timeout_s`` the request is
decided by this replica's own ``LimitRegistry`` (``on_failure: local``) or refused with 503
(``refuse``); a request is settled where it was admitted."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from proxy.api.errors import shared_state_unavailable
from proxy.api.reply_headers import BucketWindow
from proxy.config.tenants import Tenant
from proxy.replicas.client import SharedStateDown, SharedStore, may_have_run
from proxy.replicas.scripts import ADMIT, RENEW, SETTLE
from proxy.scheduling.limits import LimitChanges, LimitRegistry, LimitVerdict
from proxy.tasks import OwnedTask

log = logging.getLogger("tierproxy.replicas")


@dataclass(frozen=True)
class _SharedHold:
    tenant: str
    member: str  # this request's lease in the tenant's concurrency set ("" when uncapped)
    # Admitted by this replica's own registry (Redis away): its lease is renewed into Redis
    # once Redis answers, so that the requests it runs count there too.
    local: bool = False


class SharedLimitRegistry:
    """``proxy.scheduling.limits.TenantLimits`` over Redis, with
    this replica's registry as the fallback."""

    def __init__(self, store: SharedStore, local: LimitRegistry | None = None) -> None:
        self.store = store
        self.local = local if local is not None else LimitRegistry()
        self.replica = uuid.uuid4().hex[:12]
        self._tenants: dict[str, Tenant] = {}
        # Admission key (minted here, LimitVerdict.hold) -> its hold (shared or local). Never a
        # client's X-Request-Id: a reused one would merge admissions (slots and tpm debits lost).
        self._held: dict[str, _SharedHold] = {}
        self._admissions = itertools.count(1)
        self._settling: set[asyncio.Task[None]] = set()
        # Concurrency set -> leases to take out (their request ended, or never ran here) that
        # Redis has not confirmed gone: sent with each renewal until it does.
        self._releases: dict[str, set[str]] = {}
        self._renewing: asyncio.Task[None] | None = None  # a renewal out of turn (_renew_soon)
        # Leases of local admissions a renewal was sent for (they may be in Redis): only these
        # are taken out when they end (a long outage's local requests would queue millions).
        self._renewed_locals: set[str] = set()
        store.on_up.append(self._on_up)
        self._renewer = OwnedTask("tierproxy-shared-renew")

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._renewer.start(self._renew_forever)

    async def stop(self) -> None:
        await self._renewer.stop()
        if self._settling:  # let the last settles reach Redis (each bounded by its timeout)
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self._flush_releases()  # once more; else they expire by their TTL

    def configure(self, tenants: list[Tenant], now: float) -> None:
        self._tenants = {t.name: t for t in tenants}
        self.local.configure(tenants, now)

    def apply_changes(self, changes: LimitChanges, now: float) -> None:
        for name in changes.removed:
            self._tenants.pop(name, None)
        self._tenants.update((t.name, t) for t in changes.changed)
        self.local.apply_changes(changes, now)

    # -- decisions -----------------------------------------------------------------------
    def _keys(self, tenant: str) -> list[str]:
        # One hash tag per tenant: a Redis Cluster keeps a tenant's keys on one slot.
        base = self.store.key("limit", "{" + tenant + "}")
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:concurrent"]

    def _mint(self) -> str:
        # Unique within this process; the replica's random id makes the lease member unique
        # across replicas.
        return f"{next(self._admissions):x}"

    async def admit(self, tenant: str, tokens: float, now: float) -> LimitVerdict:
        cfg = self._tenants.get(tenant)
        if cfg is None or not _limited(cfg):
            return LimitVerdict(True)
        hold = self._mint()
        member = f"{self.replica}:{hold}"
        capped = cfg.max_concurrent is not None
        if self.store.up:
            tpm = cfg.tokens_per_minute or 0
            try:
                allowed, wait, which, *levels = await self.store.run_or_undo(
                    ADMIT,
                    self._keys(tenant),
                    [
                        cfg.requests_per_minute or 0,
                        tpm,
                        tokens,
                        cfg.max_concurrent or 0,
                        member,
                        self.store.cfg.lease_ttl_s,
                    ],
                    # Admitted, but its caller left meanwhile: the slot and tokens go back.
                    lambda answer: self._give_back(tenant, tpm, tokens, member, answer),
                    # Its call failed once sent (a stall past the call timeout): Redis may
                    # run it when it wakes, and its lease would hold a slot for nothing.
                    lost=lambda: self._release_later(tenant, member, capped),
                )
            except SharedStateDown as failure:
                if may_have_run(failure):
                    self._release_later(tenant, member, capped)
                # decided below, without Redis
            else:
                for key in filter(None, _text(levels[-1]).split("\n")):
                    self.store.bad_key("limit", key, "reset (a full bucket, as after a restart)")
                if int(allowed) != 1:
                    return LimitVerdict(False, float(wait), _text(which))
                self._held[hold] = _SharedHold(tenant, member if capped else "")
                return LimitVerdict(True, hold=hold, windows=_windows(cfg, levels[:2]))
        if self.store.cfg.on_failure == "refuse":
            raise shared_state_unavailable(self.store.cfg.probe_interval_s)
        # Its requests Redis admitted that still run here count against its cap too.
        verdict = self.local.try_admit(tenant, tokens, now, running=self._shared_running(tenant))
        if not verdict.allowed:
            return verdict
        # A lease of its own: the timed-out admission's member may be queued to be taken out
        # (red team, stop 59: renewed in, then taken out at once, it ran uncounted).
        local = f"{member}:local" if capped else ""
        self._held[hold] = _SharedHold(tenant, local, local=True)
        if capped and self.store.up:
            self._renew_soon()  # Redis answers (a call timed out, a busy pool): tell it now
        return LimitVerdict(True, hold=hold, windows=verdict.windows)

    def settle(
        self, tenant: str, reserved: float, used: float | None, now: float, hold: str = ""
    ) -> None:
        if hold not in self._held:
            return  # admitted with no limit at all
        held = self._held.pop(hold)
        if held.local:
            self.local.settle(tenant, reserved, used, now)
            if held.member in self._renewed_locals:  # renewed into Redis
                self._renewed_locals.discard(held.member)
                self._release_later(tenant, held.member, True)
            return
        cfg = self._tenants.get(tenant)
        tpm = (cfg.tokens_per_minute or 0) if cfg is not None else 0
        if not held.member and (not tpm or used is None or used == reserved):
            return  # nothing to give back or take
        self._settle_later(
            self._keys(tenant), [tpm, reserved, -1 if used is None else used, held.member]
        )

    def _give_back(
        self, tenant: str, tpm: float, tokens: float, member: str, answer: list[Any]
    ) -> None:
        if int(answer[0]) == 1:
            self._settle_later(self._keys(tenant), [tpm, tokens, 0, member])

    def _release_later(self, tenant: str, member: str, capped: bool) -> None:
        """Take ``member``'s lease out of Redis at the next renewal, and at each one after
        until Redis confirms it (a no-op where it never was). For an admission whose call
        failed once sent, a settle Redis did not answer, a local admission's renewed lease:
        without it the tenant's slot stayed taken until the lease ran out (with
        ``max_concurrent: 1``, every request of its refused meanwhile, and longer where a
        stalled admission ran when Redis woke). What an admission took of the minute's tokens
        cannot be told apart from others' and refills."""
        if capped:
            self._releases.setdefault(self._keys(tenant)[2], set()).add(member)

    async def _flush_releases(self) -> None:
        if not self._releases or not self.store.up:
            return
        for key, members in list(self._releases.items()):
            sent = tuple(members)

            async def zrem(redis: Redis, key: str = key, sent: tuple[str, ...] = sent) -> int:
                return int(await redis.zrem(key, *sent))

            try:
                await self.store.call(zrem)
            except SharedStateDown:
                return  # the next renewal sends them again
            members.difference_update(sent)
            if not members:
                del self._releases[key]

    def _settle_later(self, keys: list[str], args: list[object]) -> None:
        self._spawn(self._settle(keys, args))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """``work`` in a task of this registry's (``stop`` awaits them)."""
        task = asyncio.create_task(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def _settle(self, keys: list[str], args: list[object]) -> None:
        # Not answered (Redis down, or slow): the lease is taken out at the next renewals, the
        # token correction is forgone (docs/scale-out.md, failure modes).
        try:
            await self.store.run(SETTLE, [keys[1], keys[2]], args)
        except SharedStateDown:
            if member := str(args[3]):
                self._releases.setdefault(keys[2], set()).add(member)

    def windows(self, tenant: str, now: float) -> dict[str, BucketWindow]:
        """The x-ratelimit-* figures: none while Redis decides (the global levels live there
        and reading them back would cost a round trip per answer); this replica's own while it
        decides locally."""
        return {} if self.store.up else self.local.windows(tenant, now)

    def concurrent(self, tenant: str) -> int:
        """This replica's requests of ``tenant`` holding a limit (shared or local)."""
        return self._shared_running(tenant) + self.local.concurrent(tenant)

    def _shared_running(self, tenant: str) -> int:
        return sum(1 for h in self._held.values() if h.tenant == tenant and not h.local)

    # -- leases --------------------------------------------------------------------------
    async def _renew_forever(self) -> None:
        interval = min(self.store.cfg.sync_interval_s * 10, self.store.cfg.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            await self._renew_and_release()

    def _on_up(self) -> None:
        """Redis answers again: the leases of what runs here (admitted locally meanwhile too)
        go in, and those to take out go, now rather than at the next renewal."""
        self._renew_soon()

    def _renew_soon(self) -> None:
        """A renewal now, unless one started this way is still running."""
        if self._renewing is not None and not self._renewing.done():
            return
        self._renewing = self._spawn(self._renew_and_release())

    async def _renew_and_release(self) -> None:
        await self.renew()
        await self._flush_releases()

    async def renew(self) -> None:
        """Push the leases of this replica's running capped requests forward by the TTL (those
        admitted locally while Redis was away too: they run, and count there from now)."""
        holds = [h for h in self._held.values() if h.member]
        if not holds or not self.store.up:
            return
        keys = [self._keys(h.tenant)[2] for h in holds]
        args = [self.store.cfg.lease_ttl_s, *(h.member for h in holds)]
        self._renewed_locals.update(h.member for h in holds if h.local)
        with contextlib.suppress(SharedStateDown):
            await self.store.run(RENEW, keys, args)


def _limited(tenant: Tenant) -> bool:
    return (
        tenant.requests_per_minute is not None
        or tenant.tokens_per_minute is not None
        or tenant.max_concurrent is not None
    )


def _windows(cfg: Tenant, levels: list[object]) -> dict[str, BucketWindow]:
    """The global buckets as the admitting script left them (its stream's x-ratelimit-*)."""
    out: dict[str, BucketWindow] = {}
    limits = (("requests", cfg.requests_per_minute), ("tokens", cfg.tokens_per_minute))
    for (name, per_min), level in zip(limits, levels, strict=False):
        if per_min is not None and (text := _text(level)):
            left = float(text)
            out[name] = BucketWindow(per_min, left, (per_min - left) / (per_min / 60.0))
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
