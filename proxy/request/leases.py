"""The lease of a route that runs no model (``proxy.api.routes``: the tokenizer's), taken
without the queue (``RequestPipeline.handle``)."""

from __future__ import annotations

from collections.abc import Callable

from proxy.api.errors import cheap_busy, no_backend
from proxy.backends.pool import BackendPool
from proxy.request.admitted import Admitted
from proxy.scheduling.dispatch import CheapLease


def direct_lease(pool: BackendPool, adm: Admitted, clock: Callable[[], float]) -> CheapLease:
    """For the routes that run no model (the tokenizer's): no queue and no generation
    room (a better tier's generation never waits behind them), but a small cap of their
    own per backend (``backends[].max_cheap_inflight``), half of it at most per tenant."""
    tenant = adm.tenant.name
    backend = pool.acquire_cheap(adm.parsed.model, clock(), tenant, adm.queued.failed_on)
    if backend is not None:
        return CheapLease(backend, pool, granted_at=clock(), tenant=tenant)
    if not pool.any_available(clock()):
        raise no_backend("No backend that serves the model is available; retry later.")
    raise cheap_busy()
