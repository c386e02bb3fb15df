"""Every error the proxy answers is OpenAI-shaped JSON, whatever raised it.

The pipeline answers its own refusals; this middleware catches the rest: aiohttp's HTTP
exceptions (an unknown path, a wrong method) and exceptions nobody expected, which get a 500 and
ONE log line (where it was raised, never a traceback per request: a client that can trigger a bug
must not be able to flood the log with it).
"""

from __future__ import annotations

import asyncio
import logging
import traceback

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.errors import ProxyError, http_error, internal_error, unknown_url

log = logging.getLogger("tierproxy")


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like are answers, not errors
        if exc.status == 404:
            resp = unknown_url(request.method, request.path).response()
        else:
            resp = http_error(exc.status, exc.reason).response()
        for name in ("Allow", "Retry-After"):
            if name in exc.headers:
                resp.headers[name] = exc.headers[name]
        return resp
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.error(
            "unhandled %s on %s %s at %s: %s",
            type(exc).__name__,
            request.method,
            request.path,
            _where(exc),
            str(exc)[:200],
        )
        return internal_error().response()


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


async def json_error_bodies(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the errors aiohttp answers outside the middleware (an unknown
    ``Expect``, for one) in the OpenAI shape as well."""
    if response.status < 400 or not isinstance(response, web.Response):
        return
    if response.content_type == "application/json":
        return
    reason = response.text if response.body is not None and response.text else response.reason
    err = http_error(response.status, response.reason)
    err.message = (reason or err.message)[:500]
    body = orjson.dumps(err.body())
    response.body = body
    response.content_type = "application/json"
    if "Content-Length" in response.headers:  # set already for the plain-text body
        response.headers["Content-Length"] = str(len(body))
