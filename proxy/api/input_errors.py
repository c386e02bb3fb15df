"""The refusals of a client's input before it is parsed (issue #12): bodies too deep or of too
many values, slow, of a coding the proxy does not take or does not decode, framing aiohttp's
parser refuses. OpenAI-shaped, as every refusal (``proxy.api.errors.ProxyError``)."""

from __future__ import annotations

from proxy.api.errors import ProxyError


def too_deep(limit: int) -> ProxyError:
    return ProxyError(
        400,
        f"The body nests arrays and objects more than {limit} levels deep.",
        code="json_too_deep",
    )


def too_many_elements(what: str, limit: int, knob: str) -> ProxyError:
    return ProxyError(
        400,
        f"The body holds more than {limit} {what} (input.{knob}).",
        code="json_too_many_elements",
    )


def body_timeout(limit_s: float) -> ProxyError:
    return ProxyError(
        408,
        f"The request body did not arrive within {limit_s:g}s.",
        code="body_timeout",
    )


def unsupported_encoding(encoding: str, supported: list[str]) -> ProxyError:
    accepted = ", ".join(["identity", *supported])
    return ProxyError(
        415,
        f"Content-Encoding {encoding!r} is not supported; send one of: {accepted}.",
        code="unsupported_content_encoding",
    )


def bad_encoding(encoding: str) -> ProxyError:
    return ProxyError(
        400,
        f"The body is not valid {encoding} data.",
        code="invalid_content_encoding",
    )


def too_many_members(encoding: str, limit: int) -> ProxyError:
    return ProxyError(
        400,
        f"The {encoding} body has more than {limit} members; send it as one.",
        code="invalid_content_encoding",
    )


def bad_framing(message: str) -> ProxyError:
    return ProxyError(400, f"The request body could not be read: {message}", code="bad_framing")


def http_error(status: int, reason: str) -> ProxyError:
    """aiohttp's own HTTP errors (405, 413, framing errors ...) in the OpenAI shape."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = reason.lower().replace(" ", "_") or None
    return ProxyError(status, reason or f"HTTP {status}", type=kind, code=code)
