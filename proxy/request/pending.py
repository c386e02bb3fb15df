"""The admitted requests that wait for a backend (in the queue, or for their tenant's limit
before it), held to each reload as a new request would be (docs/quotas.md, "Reloads"; red team
F3 of round rt4: queued requests of a revoked key, or past a lowered quota, were served after
the reload):

- a request whose key no longer maps to its tenant (removed, its tenant removed, moved to
  another tenant, past a new ``expires_at``) is answered the 401 a new request with the key
  gets;
- where a reload changed a tenant's quota or budget limits, its waiting requests are decided
  again in queue order (earliest first) against the new limits: the earliest stay while they
  fit, the rest get the admission's 429 and give their reservation back;
- a request kept whose tenant moved to another tier takes that tier (its queue, its priority).

``reload_verdicts`` is the policy, a plain function of the waiting requests, the new config
and the counters; ``PendingAdmissions`` the mechanism (who waits, and answering them). Requests
that hold a lease (running at a backend) are never touched: billed what vLLM ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from proxy.api.errors import ProxyError, config_changed
from proxy.api.quota_counters import COUNTERS
from proxy.api.quota_errors import unpriced
from proxy.backends.pool import BackendPool
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import Tenant
from proxy.policies.types import State
from proxy.relay.forward import RelayResult
from proxy.request.admitted import Admitted
from proxy.request.auth import key_refusal
from proxy.request.quota_gate import QuotaGate, quota_limits
from proxy.request.tenancy import still_may_use
from proxy.scheduling.dispatch import Dispatcher
from proxy.scheduling.quotas import QuotaHold, QuotaVerdict, still_covered

log = logging.getLogger("tierproxy")

# A tenant's counters as the quota book knows them: (tenant, limits) -> counter -> use.
UsedOf = Callable[[str, Mapping[str, float]], Mapping[str, float]]
# What a reload says of one waiting request: None (it stays), the error it is answered (a key
# no longer valid, a model without a price under a new budget), or the quota's refusal.
Verdict = ProxyError | QuotaVerdict | None


def reload_verdicts(
    waiting: Sequence[Admitted], loaded: LoadedConfig, used: UsedOf, wall: float
) -> list[Verdict]:
    """The verdict of each waiting request (``waiting``: in queue order, earliest first) under
    the reloaded ``loaded``, read at ``wall`` (POSIX seconds: keys' expiry, quota periods)."""
    verdicts: list[Verdict] = [None] * len(waiting)
    rechecked: dict[str, list[int]] = {}  # tenant -> its requests whose limits may have changed
    changed: set[str] = set()
    for i, adm in enumerate(waiting):
        refusal = key_refusal(loaded, adm.key_hash, adm.tenant.name, lambda: wall)
        if refusal is not None:
            verdicts[i] = refusal
            continue
        tenant = loaded.tenant_by_key_hash[adm.key_hash]
        limits = quota_limits(loaded.config, tenant)
        rechecked.setdefault(tenant.name, []).append(i)
        if limits != quota_limits(adm.config, adm.tenant):
            changed.add(tenant.name)
    for name in changed:
        mine = rechecked[name]
        tenant = loaded.tenant_by_key_hash[waiting[mine[0]].key_hash]
        limits = quota_limits(loaded.config, tenant)
        money = any(COUNTERS[c].money for c in limits)
        held: list[tuple[int, QuotaHold]] = []
        for i in mine:
            adm = waiting[i]
            if money and adm.billed.price is None:  # as at admission: never run for free
                verdicts[i] = unpriced(adm.billed.model)
            elif not _reserved_on(adm.quota_hold, limits):
                # It reserved nothing on a counter its tenant now has (a tenant given its first
                # quota, or a new one): kept, it would run uncharged there (red team, stop 57:
                # 2,415 tokens run after a reload set 100, the counter at 0). Sent again, it is
                # admitted against them.
                verdicts[i] = config_changed()
            elif adm.quota_hold is not None:
                held.append((i, adm.quota_hold))
        decided = still_covered([h for _, h in held], limits, used(name, limits), wall)
        for (i, _), verdict in zip(held, decided, strict=True):
            verdicts[i] = None if verdict.allowed else verdict
    return verdicts


def _reserved_on(hold: QuotaHold | None, limits: Mapping[str, float]) -> bool:
    """Whether ``hold`` reserved on every counter of ``limits`` (none: trivially)."""
    charged = {counter for counter, _ in hold.periods} if hold is not None else set()
    return set(limits) <= charged


def waits(adm: Admitted) -> bool:
    """Admitted and holding no lease: queued, or not yet queued (its tenant's limit, the
    prompt's blocks). Not a request a backend runs, nor one between two attempts."""
    waiter = adm.queued.waiter
    return adm.queued.state is State.QUEUED and (waiter is None or not waiter.done())


class PendingAdmissions:
    """The requests admitted and not yet ended, by identity; a reload answers those of them
    that wait and may no longer be served (``reload_verdicts``)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        quotas: QuotaGate,
        pool: BackendPool,
    ) -> None:
        self.dispatcher = dispatcher
        self.quotas = quotas  # its wall clock (POSIX seconds) reads keys' expiry too
        self.pool = pool
        self._admitted: dict[int, Admitted] = {}

    def __len__(self) -> int:
        return len(self._admitted)

    async def admit(self, adm: Admitted) -> None:
        """Reserve its quotas (``QuotaGate.reserve``: refused, never waited for), and count it
        among the admitted from here on, until it ``ended``."""
        await self.quotas.reserve(adm)
        self._admitted[id(adm)] = adm

    def ended(self, adm: Admitted, result: RelayResult | None) -> None:
        """Its handler ends (once): its quotas settled (``QuotaGate.settle``), and forgotten."""
        self._admitted.pop(id(adm), None)
        self.quotas.settle(adm, result)

    def waiting(self) -> list[Admitted]:
        """Those that wait for a backend, in queue order (arrival; admission among equals)."""
        return sorted(filter(waits, self._admitted.values()), key=lambda adm: adm.arrival)

    def reload(self, loaded: LoadedConfig) -> int:
        """Apply ``reload_verdicts`` of a config just put in force (on the loop, before the
        dispatcher's next pass): a queued request refused leaves the queue and is answered now;
        one not yet queued is answered as it would enter it. Its handler's end gives its
        reservations back (settled to nothing: it never ran). How many were refused."""
        waiting, wall = self.waiting(), self.quotas.wall()
        verdicts = reload_verdicts(waiting, loaded, self._used(wall), wall)
        refused = 0
        for adm, verdict in zip(waiting, verdicts, strict=True):
            if verdict is None:
                if adm.queued.waiter is not None:  # one not yet queued takes it as it enters
                    self._adopt(adm, loaded, queued=True)
                continue
            refused += 1
            if not isinstance(verdict, ProxyError):
                verdict = self.quotas.refusal(adm.tenant.name, verdict)
            if adm.queued.waiter is None:
                adm.refusal = verdict
            else:
                self.dispatcher.refuse(adm.queued, verdict)
        if refused:
            log.warning(
                "%d waiting requests refused by the reload: their key no longer valid, or past"
                " their tenant's new quota",
                refused,
            )
        return refused

    def entering(self, adm: Admitted, loaded: LoadedConfig) -> None:
        """As ``adm`` enters the queue (first, or again after a backend failed): a reload's
        refusal raised; after a reload since its admission, its key and model checked again
        and its tenant's tier taken (it may have waited for its tenant's limit meanwhile)."""
        if adm.refusal is not None:
            raise adm.refusal
        if loaded.config is adm.config:
            return
        wall = self.quotas.wall()
        (verdict,) = reload_verdicts([adm], loaded, self._used(wall), wall)
        if isinstance(verdict, QuotaVerdict):  # back from a backend that did not run it
            verdict = self.quotas.refusal(adm.tenant.name, verdict)
        if verdict is not None:
            raise verdict
        still_may_use(self.pool, loaded.config, adm)
        self._adopt(adm, loaded, queued=False)

    def _used(self, wall: float) -> UsedOf:
        return lambda tenant, limits: self.quotas.used(tenant, limits, wall)

    def _adopt(self, adm: Admitted, loaded: LoadedConfig, *, queued: bool) -> None:
        """A request kept whose tenant is now in another tier: under the new config from here
        on (its queue, its priority, the ``priority`` sent to vLLM); moved to that tier's queue
        when ``queued``. A client never keeps a priority its tenant no longer has."""
        tenant: Tenant = loaded.tenant_by_key_hash[adm.key_hash]
        if tenant.tier == adm.tier:
            return
        if queued and not self.dispatcher.move(adm.queued, tenant.tier):
            return
        adm.config, adm.tenant = loaded.config, tenant
        adm.queued.tier = tenant.tier
