"""Bodies still coming in, per tenant (``input.max_uploads_per_tenant``).

The connection cap evicts only connections that have not sent a whole head; a request in
progress is never cut, and a tenant's rate limits are checked only once its body is in (the
token estimate needs it). So a tenant with a valid key could hold every connection with uploads
of a byte every few seconds and lock the other tenants out. Counted from the key's check to the
body's end; past the bound the request is refused at once and its connection closed unread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from proxy.api.errors import ProxyError
from proxy.backends.counts import TenantCounts
from proxy.config.schema import Config


class UploadRefused(ProxyError):
    """Refused before its body was read: answered, then the connection closed (``closing``)."""


def too_many_uploads(limit: int) -> UploadRefused:
    return UploadRefused(
        429,
        f"This API key's tenant already has {limit} request bodies being uploaded; wait for"
        " them to finish.",
        type="rate_limit_error",
        code="too_many_uploads",
        retry_after_s=1,
    )


def upload_bound(config: Config) -> int:
    bound = config.input.max_uploads_per_tenant
    return bound if bound is not None else max(1, config.server.max_connections // 4)


class TenantUploads:
    def __init__(self) -> None:
        self.reading = TenantCounts()

    @contextmanager
    def body_of(self, tenant: str, config: Config) -> Iterator[None]:
        """While a body of ``tenant`` is read; past its bound, ``UploadRefused``."""
        bound = upload_bound(config)
        if not self.reading.take(tenant, bound):
            raise too_many_uploads(bound)
        try:
            yield
        finally:
            self.reading.give_back(tenant)


async def closing(request: web.Request, refused: web.Response) -> web.Response:
    """``refused`` written now, then the connection closed: aiohttp would otherwise read the
    unread body on for its lingering time (10 s), holding the slot the refusal is meant to
    free. The transport sends what was written before it closes."""
    refused.force_close()
    await refused.prepare(request)
    await refused.write_eof()
    if request.transport is not None:
        request.transport.close()
    return refused
