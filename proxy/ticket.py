"""The ticket: the one header contract between the proxy and the vLLM plugin.

The proxy signs what it decided about a request (tier, priority, tenant, deadline, prefill
share, output budget); the plugin inside vLLM verifies the signature and trusts nothing else a
caller sends. Both sides import this module; it must stay free of aiohttp and vLLM imports.

Wire format (ASCII, one header)::

    X-Tierproxy-Ticket: v1.<payload>.<signature>
    payload   = base64url(JSON of the Ticket fields)
    signature = base64url(HMAC-SHA256(secret, "v1." + payload))
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from dataclasses import asdict, dataclass

TICKET_HEADER = "X-Tierproxy-Ticket"
TICKET_VERSION = "v1"
DEFAULT_SECRET_ENV = "TIERPROXY_TICKET_SECRET"

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
XARG_DEADLINE = f"{XARG_PREFIX}deadline"
XARG_PREFILL_SHARE = f"{XARG_PREFIX}prefill_share"
XARG_BUDGET = f"{XARG_PREFIX}budget"
XARG_TRUSTED = f"{XARG_PREFIX}trusted"


class TicketError(ValueError):
    """The header is missing, malformed, forged or for another version."""


@dataclass(frozen=True, slots=True)
class Ticket:
    tier: str
    priority: int  # vLLM convention: lower runs earlier
    tenant: str
    deadline: float  # unix epoch seconds; past it nobody waits for the answer
    prefill_share: float  # max share of a step's tokens for this request's tier prefill
    budget: int  # max output tokens the proxy allowed
    request_id: str

    def expired(self, now_epoch: float) -> bool:
        return now_epoch >= self.deadline


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(secret: bytes, signed: str) -> str:
    return _b64(hmac.new(secret, signed.encode("ascii"), hashlib.sha256).digest())


def encode_ticket(ticket: Ticket, secret: bytes) -> str:
    if not secret:
        raise ValueError("ticket secret must not be empty")
    payload = json.dumps(asdict(ticket), separators=(",", ":"), sort_keys=True)
    signed = f"{TICKET_VERSION}.{_b64(payload.encode('utf-8'))}"
    return f"{signed}.{_signature(secret, signed)}"


def decode_ticket(value: str, secret: bytes) -> Ticket:
    """Verify and parse a header value; raises TicketError on anything but a valid ticket."""
    if not secret:
        raise TicketError("no ticket secret configured")
    parts = value.strip().split(".")
    if len(parts) != 3 or parts[0] != TICKET_VERSION:
        raise TicketError("malformed ticket")
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
        )
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise TicketError(f"unreadable ticket payload: {exc}") from exc


def secret_from_env(env_name: str = DEFAULT_SECRET_ENV) -> bytes:
    return os.environ.get(env_name, "").encode("utf-8")
