"""``Expect: 100-continue`` on the model routes: the key and the announced size are checked
before the client is invited to send its body (aiohttp's default answers ``100 Continue`` to
anyone, so an unauthenticated client, or one announcing 100 MB past ``limits.max_body_bytes``,
was asked to upload what would be refused)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http import HttpVersion11

from proxy.api.errors import ProxyError, too_large
from proxy.config.tenants import Tenant
from proxy.request.admitted import Trace
from proxy.request.auth import identify

if TYPE_CHECKING:
    from proxy.request.pipeline import RequestPipeline

ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def expect_checker(pipeline: RequestPipeline) -> ExpectHandler:
    """An aiohttp ``expect_handler``: 401 / 413 (OpenAI JSON, connection closed: the body was
    never sent) instead of ``100 Continue``; 417 for an expectation other than 100-continue.
    The refusals have their own id, access-log line and metrics, like the handler's."""

    def refuse(
        request: web.Request, err: ProxyError, tenant: Tenant | None, key_hash: str
    ) -> web.Response:
        trace = Trace.begin(request.headers, pipeline.clock())
        trace.tenant, trace.key_hash = tenant, key_hash
        refused = pipeline.answers.refuse(trace, err)
        pipeline.on_finish(trace, None, None)
        pipeline.answers.log(trace)
        return refused

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.headers.get("Expect", "").lower() != "100-continue":
            refused = refuse(request, expectation_failed(request.headers["Expect"]), None, "")
            refused.force_close()
            return refused
        if request.version != HttpVersion11:
            return None  # HTTP/1.0 knows no 100 Continue: the body comes anyway
        loaded = pipeline.config()
        limit = loaded.config.limits.max_body_bytes
        tenant: Tenant | None = None
        key_hash = ""
        try:
            tenant, key_hash = identify(request.headers, loaded)
            if request.content_length is not None and request.content_length > limit:
                raise too_large(limit)
        except ProxyError as err:
            refused = refuse(request, err, tenant, key_hash)
            refused.force_close()  # the announced body never comes: nothing to read past
            return refused
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the 100 is not part of the response's size
        return None

    return expect


def expectation_failed(expect: str) -> ProxyError:
    return ProxyError(
        417, f"Unknown Expect: {expect[:64]!r} (only 100-continue).", code="expectation_failed"
    )


def no_continue(
    answer: Callable[[web.Request], Awaitable[web.Response]],
) -> ExpectHandler:
    """The ``expect_handler`` of a route that never reads a body (405, an unknown /v1 path):
    its answer at once, never ``100 Continue`` (aiohttp's default invites anyone to upload)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        refused = await answer(request)
        refused.force_close()
        return refused

    return expect
