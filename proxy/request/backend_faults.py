"""What a backend's failure during ``forward`` does: counted against the backend (passive
ejection), logged, and the request either refused (``proxy.request.poison``) or sent back to the
queue for another backend."""

from __future__ import annotations

import logging

from proxy.backends.pool import BackendPool
from proxy.relay.result import UpstreamUnavailable
from proxy.request.admitted import Admitted
from proxy.request.poison import blame, give_up, refuse_poison
from proxy.scheduling.dispatch import CheapLease, Lease
from proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger("tierproxy")


def retry_elsewhere(
    exc: UpstreamUnavailable,
    adm: Admitted,
    lease: Lease | CheapLease,
    pool: BackendPool,
    metrics: ProxyMetrics,
    now: float,
) -> None:
    """Return: the request goes back into the queue at its old place, for another backend if
    any; raise: the client's answer (a poison pill, or its attempts ran out)."""
    blamed = blame(exc, lease)  # read before this failure is recorded
    pool.record_failure(lease.backend, now, definitive=exc.kind == "connect")
    metrics.backend_errors.labels(lease.backend.label, exc.kind).inc()
    label, attempt = lease.backend.label, adm.attempts
    log.warning("request %s: backend %s unavailable (%s); attempt %d", adm.request_id,
                label, exc.kind, attempt)  # fmt: skip
    refuse_poison(blamed, adm, label)
    if adm.attempts >= adm.config.backend_health.max_attempts:
        raise give_up(exc) from None
    metrics.retries.inc()
    adm.queued.failed_on |= {lease.backend.cfg.url}


def no_answer_head(
    adm: Admitted, lease: Lease | CheapLease, pool: BackendPool, metrics: ProxyMetrics, now: float
) -> None:
    """The tier's limit passed without the answer's head (``NoAnswerHead``). For a stream it
    is the backend's failure (two in a row eject it, as resets do); a non-streamed answer's
    head comes only with its end, so its absence says nothing of the backend, and the engine
    ran it: billed its reservation (``Delivered.deadline_cut``)."""
    label = lease.backend.label
    if not adm.parsed.stream:
        # Its head sent, the engine ran it (billed its reservation); still connecting, none did.
        adm.delivered.deadline_cut = adm.delivered.head_sent is not False
        return
    pool.record_failure(lease.backend, now)
    metrics.backend_errors.labels(label, "no_answer_head").inc()
    log.warning("request %s: backend %s sent no answer head within the tier's limit;"
                " counted as its failure", adm.request_id, label)  # fmt: skip
