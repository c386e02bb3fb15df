"""What the pipeline tells a request's spans about its backend (``proxy.telemetry.spans``);
called only where tracing is on."""

from __future__ import annotations

from urllib.parse import urlsplit

from proxy.request.admitted import Admitted
from proxy.scheduling.dispatch import CheapLease, Lease


def upstream_spans(adm: Admitted, lease: Lease | CheapLease, now: float) -> dict[str, str]:
    """The dispatch span (backend, its room) and the upstream span starting now of a traced
    request; returns the ``traceparent``/``tracestate`` headers for the backend."""
    assert adm.spans is not None, "called only where tracing is on"
    backend = lease.backend
    return adm.spans.upstream(
        backend=backend.label,
        address=urlsplit(backend.cfg.url).netloc,
        # A tokenizer call takes no generation room.
        room=backend.max_room if isinstance(lease, Lease) else None,
        inflight=backend.inflight,
        granted_at=lease.granted_at,
        path=adm.parsed.upstream_path,
        now=now,
    )
