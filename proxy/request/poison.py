"""Whether a backend's failure may be the request's own doing: a poison pill (an input that
crashes vLLM's engine core) must not be retried into every engine of the fleet (finding #11)."""

from __future__ import annotations

import logging

from proxy.api.errors import (
    ProxyError,
    backend_overloaded,
    backends_failed,
    engine_killed,
    no_backend,
    poison_pill,
)
from proxy.relay.forward import UpstreamUnavailable
from proxy.request.admitted import Admitted
from proxy.scheduling.dispatch import CheapLease, Lease

log = logging.getLogger("tierproxy")


def blame(exc: UpstreamUnavailable, lease: Lease | CheapLease) -> str | None:
    """How far a backend's failure may be the request's doing: "alone" (its engine died while
    it was the only request there: the likely poison pill, never retried), "maybe" (it may
    have run there: retried within ``relay.max_reset_retries``), None (it cannot have: retried
    within ``backend_health.max_attempts``). An engine already failing when the request was
    handed to it (its requests or its /health probes failing) was most likely dead before it
    arrived: that death is not its doing."""
    if not exc.maybe_ran:
        return None
    state = lease.backend
    if exc.kind != "engine_dead":
        return "maybe"
    signs = [t for t in (state.failing_since, state.probe_failing_since) if t is not None]
    if signs:
        # Failing before it was sent: dead already. Since: others ran there when it died.
        return None if min(signs) < lease.granted_at else "maybe"
    return "alone" if state.inflight + state.cheap_inflight <= 1 else "maybe"


def refuse_poison(blamed: str | None, adm: Admitted, backend: str) -> None:
    """Raise the 502 of a request that must not be retried after this failure (``blame``):
    alone on an engine that died, or past ``relay.max_reset_retries`` failures it may have
    caused; otherwise count the failure it may have caused and return."""
    if blamed == "alone":
        log.warning(
            "request %s of tenant %s: backend %s's engine died running it alone;"
            " not retried (poison pill)",
            adm.request_id,
            adm.tenant.name,
            backend,
        )
        raise engine_killed() from None
    if blamed == "maybe":
        adm.resets += 1
        if adm.resets > adm.config.relay.max_reset_retries:
            raise poison_pill(adm.resets) from None


def give_up(exc: UpstreamUnavailable) -> ProxyError:
    """The answer once a request's attempts ran out on backends that failed."""
    if exc.status == 503:
        return backend_overloaded()
    if exc.kind != "connect":  # the backends answered, and broke
        return backends_failed(exc.kind)
    return no_backend(f"No backend could take the request ({exc.kind}); retry later.")
