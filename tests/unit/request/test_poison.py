"""blame: an engine's death is the request's doing only where nothing said it was dying first."""

from __future__ import annotations

from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised
from proxy.relay.result import UpstreamUnavailable
from proxy.request.poison import blame
from proxy.scheduling.dispatch import CheapLease

DEAD = UpstreamUnavailable("engine_dead", "the backend's engine died", status=500)


def _lease(granted_at: float) -> tuple[BackendPool, CheapLease]:
    pool = BackendPool([Backend(url="http://b0:80")], BackendHealth(), LeastUtilised())
    state = pool.all()[0]
    state.inflight = 1  # this request, alone there
    return pool, CheapLease(state, pool, granted_at=granted_at, tenant="t")


def test_alone_on_an_engine_that_seemed_well_is_the_likely_poison_pill() -> None:
    _, lease = _lease(granted_at=5.0)
    assert blame(DEAD, lease) == "alone"


def test_an_engine_whose_probes_failed_before_the_request_came_was_dead_already() -> None:
    pool, lease = _lease(granted_at=5.0)
    pool.probe_result(lease.backend, False, 4.0)  # one failed probe: still in rotation
    assert blame(DEAD, lease) is None


def test_probes_failing_only_after_it_was_sent_leave_it_suspect() -> None:
    pool, lease = _lease(granted_at=5.0)
    pool.probe_result(lease.backend, False, 6.0)
    assert blame(DEAD, lease) == "maybe"
