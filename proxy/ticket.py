"""The ticket: the one header contract between the proxy and the vLLM plugin.

The proxy signs what it decided about a request (tier, priority, tenant, deadline, prefill
share, output budget) and binds it to that one request; the plugin inside vLLM verifies the
signature and the binding, and trusts nothing else a caller sends. Both sides import this
module; it must stay free of aiohttp and vLLM imports.

Wire format (ASCII, one header)::

    X-Tierproxy-Ticket: v2.<payload>.<signature>
    payload   = base64url(JSON of the Ticket fields, sorted keys)
    signature = base64url(HMAC-SHA256(secret, "v2." + payload))

Binding: ``body_sha256`` is the RFC 9530 ``sha-256`` value (base64 of the SHA-256 of the exact
body bytes sent), ``request_id`` equals the ``X-Request-Id`` header, ``issued_at`` starts a short
validity window the plugin enforces, and ``nonce`` is single-use within that window. v1 tickets
(no binding) are refused.

Cache salt: ``cache_salt`` is the prefix-cache salt the proxy put into the body
(``derive_cache_salt``: an HMAC of the ticket secret and the tenant's cache scope, so stable
across replicas and restarts and unguessable without the secret). The plugin refuses a ticketed
request whose body carries another salt. The field is in the payload only when set, and a
ticket without it (an older proxy) reads as ``""``: no salt bound; an older plugin reads the
fields it knows and ignores this one, so v2 stays v2 across a rolling upgrade.

Time: the proxy and vLLM run on different hosts whose clocks disagree. The deadline travels as
a duration: ``time_limit_s`` (= ``deadline - issued_at``, both stamped by the proxy's one clock,
so no skew between hosts enters it), counted by the plugin from when it receives the request on
its own clock. ``deadline`` stays in the payload so that v2 tickets keep their exact format
(a proxy and a plugin of different versions interoperate during a rolling upgrade); nothing
compares it with another host's clock. Only ``issued_at`` is compared across hosts (the
validity window), within ``TIERPROXY_TICKET_MAX_SKEW_S``; a ticket outside it is refused with a
rate-limited warning and counted (``proxy.vllm_plugin.clock``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, fields

TICKET_HEADER = "X-Tierproxy-Ticket"
REQUEST_ID_HEADER = "X-Request-Id"
# RFC 9530: informative copy of the digest the ticket signs (the plugin trusts only the ticket's).
CONTENT_DIGEST_HEADER = "Content-Digest"
TICKET_VERSION = "v2"
DEFAULT_SECRET_ENV = "TIERPROXY_TICKET_SECRET"

# HMAC-SHA256 keys shorter than the hash add no strength and are guessable offline from one
# captured ticket; the example .env's value must be replaced, never used.
MIN_SECRET_BYTES = 32
PLACEHOLDER_SECRETS: frozenset[bytes] = frozenset({b"change-me-to-a-long-random-string"})

# vLLM flags that load the plugin into a stock server: the middleware (API server), the
# scheduler (engine core; one class for CPU and GPU, it follows vLLM's async-scheduling choice)
# and priority scheduling, which makes vLLM honour the priority the ticket sets.
MIDDLEWARE_CLASS = "proxy.vllm_plugin.middleware.TicketMiddleware"
SCHEDULER_CLASS = "proxy.vllm_plugin.scheduler.TierScheduler"
PRIORITY_FLAGS: tuple[str, ...] = ("--scheduling-policy", "priority")
PLUGIN_CLASS_FLAGS: tuple[str, ...] = (
    "--middleware",
    MIDDLEWARE_CLASS,
    "--scheduler-cls",
    SCHEDULER_CLASS,
)
PLUGIN_FLAGS: tuple[str, ...] = PRIORITY_FLAGS + PLUGIN_CLASS_FLAGS

# Share of a step's token budget a worse tier's prefill may take while a better tier decodes:
# the proxy's default for every tier but the best, and the plugin's for requests without one.
DEFAULT_PREFILL_SHARE = 0.2

# Keys the plugin's middleware writes into the body's ``vllm_xargs``; vLLM hands them to the
# scheduler as ``request.sampling_params.extra_args``. Every key with the prefix is ours: the
# middleware drops a caller's.
XARG_PREFIX = "tierproxy_"
XARG_TIER = f"{XARG_PREFIX}tier"
XARG_PRIORITY = f"{XARG_PREFIX}priority"
# Seconds the request may run, counted by the scheduler from when it receives the request.
XARG_TIME_LIMIT = f"{XARG_PREFIX}time_limit_s"
XARG_PREFILL_SHARE = f"{XARG_PREFIX}prefill_share"
XARG_BUDGET = f"{XARG_PREFIX}budget"
XARG_TRUSTED = f"{XARG_PREFIX}trusted"


class TicketError(ValueError):
    """The header is missing, malformed, forged or for another version."""


class SecretError(ValueError):
    """The shared secret is too short or the example placeholder."""


@dataclass(frozen=True, slots=True)
class Ticket:
    tier: str
    priority: int  # vLLM convention: lower runs earlier
    tenant: str
    # Unix epoch seconds on the proxy's clock; past it nobody waits for the answer. Read only
    # against issued_at (time_limit_s): the plugin's host clock may be seconds off.
    deadline: float
    prefill_share: float  # max share of a step's tokens for this request's tier prefill
    budget: int  # max output tokens the proxy allowed
    request_id: str  # equals the X-Request-Id header
    body_sha256: str  # body_digest() of the exact body bytes sent
    issued_at: float  # unix epoch seconds; the plugin accepts it for a short window
    nonce: str  # single use: the plugin remembers it for the window
    # The body's cache_salt as the proxy set it ("": none). Last, with a default: older
    # tickets lack it and still decode.
    cache_salt: str = ""

    @property
    def time_limit_s(self) -> float:
        """How long the request may run from when the plugin receives it: both ends on the
        proxy's clock, so skew between the hosts does not move it (0: already past)."""
        return max(0.0, self.deadline - self.issued_at)


def body_digest(body: bytes) -> str:
    """Base64 SHA-256 of the body: the value of RFC 9530's ``sha-256`` digest."""
    return base64.b64encode(hashlib.sha256(body).digest()).decode("ascii")


def content_digest(body: bytes) -> str:
    """The RFC 9530 ``Content-Digest`` header value for an identity-encoded body."""
    return f"sha-256=:{body_digest(body)}:"


def new_nonce() -> str:
    return secrets.token_urlsafe(16)


def check_secret(secret: bytes) -> bytes:
    """The secret itself if it may sign tickets; SecretError says why not."""
    if secret.strip() in PLACEHOLDER_SECRETS or secret.startswith(b"change-me"):
        raise SecretError("the ticket secret is the example placeholder: generate one")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"the ticket secret has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed"
            " (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@functools.lru_cache(maxsize=8)
def _keyed(secret: bytes) -> hmac.HMAC:
    """The HMAC with the key set up once; each signature copies it (a few µs less each)."""
    return hmac.new(secret, digestmod=hashlib.sha256)


def _signature(secret: bytes, signed: str) -> str:
    mac = _keyed(secret).copy()
    mac.update(signed.encode("ascii"))
    return _b64(mac.digest())


# The payload's keys in sorted order: the same JSON as json.dumps(asdict(t), sort_keys=True),
# without asdict's deep copy.
_SORTED_FIELDS = tuple(sorted(f.name for f in fields(Ticket)))


def encode_ticket(ticket: Ticket, secret: bytes) -> str:
    if not secret:
        raise ValueError("ticket secret must not be empty")
    ordered = {name: getattr(ticket, name) for name in _SORTED_FIELDS}
    if not ticket.cache_salt:  # none bound: the exact v2 payload of before the salt
        del ordered["cache_salt"]
    payload = json.dumps(ordered, separators=(",", ":"))
    signed = f"{TICKET_VERSION}.{_b64(payload.encode('utf-8'))}"
    return f"{signed}.{_signature(secret, signed)}"


def decode_ticket(value: str | bytes, secret: bytes) -> Ticket:
    """Verify and parse a header value; raises TicketError on anything but a valid ticket.

    Checks only the signature and the fields' types: the binding (window, body, request id,
    nonce) is the verifier's job, which has the request."""
    if not secret:
        raise TicketError("no ticket secret configured")
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise TicketError("malformed ticket: not ASCII") from None
    if not value.isascii():
        raise TicketError("malformed ticket: not ASCII")
    parts = value.strip().split(".")
    if len(parts) != 3:
        raise TicketError("malformed ticket")
    if parts[0] != TICKET_VERSION:
        raise TicketError(f"unsupported ticket version (want {TICKET_VERSION})")
    signed = f"{parts[0]}.{parts[1]}"
    if not hmac.compare_digest(_signature(secret, signed), parts[2]):
        raise TicketError("bad ticket signature")
    try:
        raw = json.loads(_unb64(parts[1]))
        return Ticket(
            tier=str(raw["tier"]),
            priority=int(raw["priority"]),
            tenant=str(raw["tenant"]),
            deadline=float(raw["deadline"]),
            prefill_share=float(raw["prefill_share"]),
            budget=int(raw["budget"]),
            request_id=str(raw["request_id"]),
            body_sha256=str(raw["body_sha256"]),
            issued_at=float(raw["issued_at"]),
            nonce=str(raw["nonce"]),
            cache_salt=str(raw.get("cache_salt", "")),
        )
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise TicketError(f"unreadable ticket payload: {exc}") from exc


# Domain separation: the salt is an HMAC under the ticket secret, never equal to a signature.
_SALT_CONTEXT = b"tierproxy cache_salt v1\x00"


@functools.lru_cache(maxsize=4096)
def derive_cache_salt(secret: bytes, scope: str) -> str:
    """The prefix-cache salt of one cache scope (a tenant, or a ``cache_group``): base64url of
    HMAC-SHA256(secret, context + scope), 43 characters (256 bits), none of the characters vLLM
    forbids in a salt (``@ / \\ NUL``). Cached: a few scopes, looked up on every request."""
    mac = hmac.new(secret, _SALT_CONTEXT + scope.encode("utf-8"), hashlib.sha256)
    return _b64(mac.digest())


def secret_from_env(env_name: str = DEFAULT_SECRET_ENV) -> bytes:
    return os.environ.get(env_name, "").encode("utf-8")
