"""A request for an adapter, once it has its slot: the adapter loaded on that backend first
(proxy.backends.adapter_loader), or a clear 503 `adapter_load_failed` when it could not be."""

from __future__ import annotations

import asyncio

from proxy.api.errors import adapter_load_failed
from proxy.backends.adapter_loader import AdapterLoader, AdapterLoadFailed
from proxy.relay.held import HeldResponse
from proxy.relay.result import RelayResult
from proxy.request.admitted import Admitted
from proxy.scheduling.dispatch import CheapLease, Lease


class AdapterGate:
    """Holds the loader (set by the server once its HTTP session exists; None: no adapters)."""

    def __init__(self) -> None:
        self.loader: AdapterLoader | None = None

    async def stop(self) -> None:
        """The proxy stops: the loads under way are cancelled and awaited."""
        if self.loader is not None:
            await self.loader.stop()

    def forgotten(
        self, lease: Lease | CheapLease, adm: Admitted, result: RelayResult | None
    ) -> bool:
        """vLLM answered 404 for an adapter the backend was counted as holding (it restarted
        and lost its runtime loads, or another replica unloaded it): the backend no longer
        counts it, and True when the request goes round again, to be loaded this time. The
        404 reached no client: its held bytes are given back and nothing is billed for it."""
        model = adm.parsed.model
        if (
            self.loader is None
            or model is None
            or result is None
            or not _model_missing(result, model)
            or not isinstance(lease, Lease)
            or not lease.backend.adapters.gone(model)
            or not lease.backend.cfg.load_adapters
            or adm.attempts >= adm.config.backend_health.max_attempts
        ):
            return False
        if isinstance(result.response, HeldResponse):
            result.response.held.release()
        adm.delivered.sent = False
        return True

    async def ready(self, lease: Lease | CheapLease, model: str | None) -> None:
        """Returns once the lease's backend holds ``model``'s adapter (at once for any other
        model); the lease is released and 503 raised when the load failed."""
        if self.loader is None or model is None or not isinstance(lease, Lease):
            return
        if model not in lease.backend.adapters.inflight:
            return  # not an adapter the pool counted
        plan, lease.adapter_plan = lease.adapter_plan, None  # this request carries it out
        # A load never keeps a request past its tier's queue timeout (red team F8: a hung
        # load held them for the backend's adapter_load_timeout_s whatever their tier's).
        deadline = lease.request.deadline_s if lease.request is not None else None
        try:
            await self.loader.ready(lease.backend, model, plan, deadline)
        except AdapterLoadFailed as exc:
            lease.release(ran=False)
            raise adapter_load_failed(exc.adapter, exc.reason, exc.retry_after_s) from None
        except asyncio.CancelledError:  # the client left while it waited for the load
            lease.release(ran=False)
            raise


def _model_missing(result: RelayResult, model: str) -> bool:
    """vLLM's own 404 for a model it does not serve ("The model `X` does not exist."), not
    any 404 (a route the engine lacks answers FastAPI's bare "Not Found")."""
    if result.status != 404:
        return False
    body = getattr(result.response, "body", None)
    if not isinstance(body, bytes):
        return False
    return b"does not exist" in body and f"`{model}`".encode() in body
