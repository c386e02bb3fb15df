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
from http import HTTPStatus

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Handler

from proxy.api.errors import ProxyError, internal_error, unknown_url
from proxy.api.input_errors import http_error

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
            where(exc),
            str(exc)[:200],
        )
        return internal_error().response()


def where(exc: BaseException) -> str:
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


# aiohttp's parser limits (its RequestHandler defaults): a longer request line or header field,
# or more header fields, is refused before any handler runs.
MAX_HEADER_FIELD_BYTES = 8190
MAX_HEADER_FIELDS = 128


def parser_error(status: int, exc: BaseException | None) -> ProxyError:
    """What aiohttp's parser refused (a malformed request line, header or framing; headers over
    its limits) or its handler could not answer, in the OpenAI shape. A line or header over the
    limit, or too many headers, is 431; every other parser error 400."""
    if status == 500:
        if isinstance(exc, UnicodeEncodeError) and _escaped_client_bytes(exc):
            # aiohttp decodes header bytes that are not UTF-8 with surrogateescape; its own
            # code before any middleware (the Expect check) fails to encode them again.
            return ProxyError(
                400, "Malformed HTTP request: a header is not valid UTF-8", code="malformed_request"
            )
        return internal_error()
    if not isinstance(exc, HttpProcessingError):
        return http_error(status, HTTPStatus(status).phrase if status in _STATUSES else "")
    detail = parser_detail(exc)
    if isinstance(exc, LineTooLong) or "Too many headers" in exc.message:
        return ProxyError(
            431,
            f"The request line or a header field is over {MAX_HEADER_FIELD_BYTES} bytes, or"
            f" there are over {MAX_HEADER_FIELDS} header fields: {detail}",
            code="request_header_fields_too_large",
        )
    return ProxyError(400, f"Malformed HTTP request: {detail}", code="malformed_request")


def _escaped_client_bytes(exc: UnicodeEncodeError) -> bool:
    bad = exc.object[exc.start : exc.end]
    return bool(bad) and all("\udc80" <= ch <= "\udcff" for ch in bad)


def parser_detail(exc: HttpProcessingError) -> str:
    """The first line of a parser error (the rest echoes the client's bytes with a caret)."""
    first = next((line for line in exc.message.splitlines() if line.strip()), "")
    return first.strip().rstrip(":")[:200] or "malformed request"


_STATUSES = {s.value for s in HTTPStatus}
