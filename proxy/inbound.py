"""What comes in from a client: the API key, the JSON body, and what must not pass on.

Clients can never raise their own priority: the body's ``priority`` and ``vllm_xargs`` and every
``X-Vllm-*`` / ``X-Tierproxy-*`` header are dropped here; only the proxy's signed ticket decides.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.config import Limits, LoadedConfig, Scheduling, Tenant, Tier
from proxy.errors import admin_disabled, bad_request, too_large, unauthorized

Endpoint = Literal["chat", "completions"]

BODY_READ_TIMEOUT_S = 30.0

STRIPPED_BODY_FIELDS = ("priority", "vllm_xargs")
STRIPPED_HEADER_PREFIXES = ("x-vllm-", "x-tierproxy-")
# Hop-by-hop and per-connection headers, and what the proxy sets itself.
DROPPED_HEADERS = frozenset(
    {
        "authorization",
        "api-key",
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-request-id",
        "accept-encoding",
    }
)


def api_key_from(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("api-key", "").strip()
    return key or None


def authenticate(headers: Mapping[str, str], loaded: LoadedConfig) -> Tenant:
    """The tenant whose key the request carries, or 401."""
    key = api_key_from(headers)
    tenant = loaded.tenant_for_key(key) if key else None
    if tenant is None:
        raise unauthorized()
    return tenant


def authenticate_admin(headers: Mapping[str, str], loaded: LoadedConfig) -> None:
    """Pass an admin key, or 404 when the admin API is off, or 401."""
    if not loaded.admin_key_hashes:
        raise admin_disabled()
    key = api_key_from(headers)
    if key is None or not loaded.is_admin_key(key):
        raise unauthorized()


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` (never read whole first)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    body = bytearray()
    async with asyncio.timeout(BODY_READ_TIMEOUT_S):
        async for chunk in request.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    return bytes(body)


def upstream_headers(client_headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client_headers.items():
        lower = name.lower()
        if lower in DROPPED_HEADERS or lower.startswith(STRIPPED_HEADER_PREFIXES):
            continue
        out.add(name, value)
    return out


@dataclass
class ParsedRequest:
    body: dict[str, Any]
    endpoint: Endpoint
    stream: bool
    model: str | None
    prompt_tokens: int  # estimate from characters
    max_tokens: int | None  # after the tier's clamp
    expected_output: int
    client_wants_usage: bool  # the client asked for the final usage chunk itself


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_chars(value: object) -> int:
    """Characters of text in a prompt or message content, however nested."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for k, v in value.items() if k in ("content", "text"))
    if _is_int(value):
        return 4  # a token id in a pre-tokenized prompt
    return 0


def _validate_messages(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages.[{i}]"
            )
        chars += _text_chars(message.get("content")) + 8
    return chars


def _validate_prompt(prompt: object) -> int:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_int(p) for p in prompt)
            or all(isinstance(p, list) and all(_is_int(x) for x in p) for p in prompt)
        )
    )
    if not ok:
        raise bad_request(
            "'prompt' must be a string, an array of strings or an array of token ids",
            param="prompt",
        )
    return _text_chars(prompt)


def parse_body(
    raw: bytes,
    endpoint: Endpoint,
    tier: Tier,
    limits: Limits,
    scheduling: Scheduling,
) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object", code="invalid_json")

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")

    if endpoint == "chat":
        chars = _validate_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt")
        chars = _validate_prompt(body["prompt"])

    for name in STRIPPED_BODY_FIELDS:
        body.pop(name, None)

    max_tokens = _clamped_max_tokens(body, tier, limits)
    n = body.get("n", 1)
    if not _is_int(n) or n < 1 or n > 128:
        raise bad_request("'n' must be an integer between 1 and 128", param="n")
    expected = max_tokens if max_tokens is not None else scheduling.default_expected_output
    if tier.max_tokens is not None:
        expected = min(expected, tier.max_tokens)

    client_wants_usage = False
    if stream:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        options = dict(options or {})
        client_wants_usage = bool(options.get("include_usage"))
        # Ask for the usage chunk anyway: fairness and metrics count real tokens. The relay
        # removes it again when the client did not ask for it.
        options["include_usage"] = True
        body["stream_options"] = options

    return ParsedRequest(
        body=body,
        endpoint=endpoint,
        stream=stream,
        model=model,
        prompt_tokens=max(1, math.ceil(chars / scheduling.chars_per_token)),
        max_tokens=max_tokens,
        expected_output=int(expected) * int(n),
        client_wants_usage=client_wants_usage,
    )


def _clamped_max_tokens(body: dict[str, Any], tier: Tier, limits: Limits) -> int | None:
    """Validate max_tokens / max_completion_tokens and clamp them to the tier's cap."""
    chosen: int | None = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise bad_request(f"'{name}' must be a positive integer", param=name)
        if value > limits.max_tokens_ceiling:
            raise bad_request(
                f"'{name}' is {value}; the most this service allows is {limits.max_tokens_ceiling}",
                param=name,
            )
        chosen = value if chosen is None else min(chosen, value)
    if tier.max_tokens is not None:
        if chosen is None or chosen > tier.max_tokens:
            chosen = tier.max_tokens
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = min(body[name], chosen)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = chosen
    return chosen
