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
from dataclasses import dataclass
from typing import Any

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


# What ``_held`` keeps for a request admitted by this replica's own registry (Redis down).
_LOCAL = None


class SharedLimitRegistry:
    """``proxy.scheduling.limits.TenantLimits`` over Redis, with
    this replica's registry as the fallback."""

    def __init__(self, store: SharedStore, local: LimitRegistry | None = None) -> None:
        self.store = store
        self.local = local if local is not None else LimitRegistry()
        self.replica = uuid.uuid4().hex[:12]
        self._tenants: dict[str, Tenant] = {}
        # Admission key (minted here, LimitVerdict.hold) -> shared hold, or _LOCAL. Never a
        # client's X-Request-Id: a reused one would merge admissions (slots and tpm debits lost).
        self._held: dict[str, _SharedHold | None] = {}
        self._admissions = itertools.count(1)
        self._settling: set[asyncio.Task[None]] = set()
        self._renewer = OwnedTask("tierproxy-shared-renew")

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._renewer.start(self._renew_forever)

    async def stop(self) -> None:
        await self._renewer.stop()
        if self._settling:  # let the last settles reach Redis (each bounded by its timeout)
            await asyncio.gather(*self._settling, return_exceptions=True)

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
        if self.store.up:
            member = f"{self.replica}:{hold}"
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
                    lost=lambda: self._release_lost(tenant, member, cfg),
                )
            except SharedStateDown as failure:
                if may_have_run(failure):
                    self._release_lost(tenant, member, cfg)
                # decided below, without Redis
            else:
                for key in filter(None, _text(levels[-1]).split("\n")):
                    self.store.bad_key("limit", key, "reset (a full bucket, as after a restart)")
                if int(allowed) != 1:
                    return LimitVerdict(False, float(wait), _text(which))
                capped = cfg.max_concurrent is not None
                self._held[hold] = _SharedHold(tenant, member if capped else "")
                return LimitVerdict(True, hold=hold, windows=_windows(cfg, levels[:2]))
        if self.store.cfg.on_failure == "refuse":
            raise shared_state_unavailable(self.store.cfg.probe_interval_s)
        verdict = self.local.try_admit(tenant, tokens, now)
        if not verdict.allowed:
            return verdict
        self._held[hold] = _LOCAL
        return LimitVerdict(True, hold=hold, windows=verdict.windows)

    def settle(
        self, tenant: str, reserved: float, used: float | None, now: float, hold: str = ""
    ) -> None:
        if hold not in self._held:
            return  # admitted with no limit at all
        held = self._held.pop(hold)
        if held is _LOCAL:
            self.local.settle(tenant, reserved, used, now)
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

    def _release_lost(self, tenant: str, member: str, cfg: Tenant) -> None:
        """An admission whose call failed once sent (a stall past the call timeout) may have
        run in Redis when it woke: its concurrency lease is taken out by its member, which is
        a no-op if it never ran (without this, the tenant's slot stayed taken until the lease
        ran out: with ``max_concurrent: 1``, every request of its refused meanwhile). What it
        took of the minute's tokens cannot be told apart from others' and refills."""
        if cfg.max_concurrent is not None:
            task = asyncio.create_task(self._release(self._keys(tenant), member))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _release(self, keys: list[str], member: str) -> None:
        """Take ``member``'s lease out, again each ``probe_interval_s`` while Redis does not
        answer, until the lease would have run out anyway."""
        cfg = self.store.cfg
        loop = asyncio.get_running_loop()
        ends = loop.time() + cfg.lease_ttl_s
        while True:
            try:
                await self.store.run(SETTLE, [keys[1], keys[2]], [0, 0, -1, member])
                return
            except SharedStateDown:
                if loop.time() + cfg.probe_interval_s >= ends:
                    return  # its lease has run out by then
                await asyncio.sleep(cfg.probe_interval_s)

    def _settle_later(self, keys: list[str], args: list[object]) -> None:
        task = asyncio.create_task(self._settle(keys, args))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, keys: list[str], args: list[object]) -> None:
        # Lost when Redis is down: the lease then expires within lease_ttl_s and the token
        # correction is forgone (docs/scale-out.md, failure modes).
        with contextlib.suppress(SharedStateDown):
            await self.store.run(SETTLE, [keys[1], keys[2]], args)

    def windows(self, tenant: str, now: float) -> dict[str, BucketWindow]:
        """The x-ratelimit-* figures: none while Redis decides (the global levels live there
        and reading them back would cost a round trip per answer); this replica's own while it
        decides locally."""
        return {} if self.store.up else self.local.windows(tenant, now)

    def concurrent(self, tenant: str) -> int:
        """This replica's requests of ``tenant`` holding a limit (shared or local)."""
        shared = sum(1 for h in self._held.values() if h is not None and h.tenant == tenant)
        return shared + self.local.concurrent(tenant)

    # -- leases --------------------------------------------------------------------------
    async def _renew_forever(self) -> None:
        interval = min(self.store.cfg.sync_interval_s * 10, self.store.cfg.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            await self.renew()

    async def renew(self) -> None:
        """Push the leases of this replica's running capped requests forward by the TTL."""
        holds = [h for h in self._held.values() if h is not None and h.member]
        if not holds or not self.store.up:
            return
        keys = [self._keys(h.tenant)[2] for h in holds]
        args = [self.store.cfg.lease_ttl_s, *(h.member for h in holds)]
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
