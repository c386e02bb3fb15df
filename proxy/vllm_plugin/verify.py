"""Is this ticket for this request, now, for the first time? The binding checks the middleware
runs after the signature: validity window, request id, body digest, single-use nonce."""

from __future__ import annotations

import heapq
import hmac

from proxy.ticket import Ticket, TicketError, body_digest, decode_ticket

# check_binding's answers about time: the only ones a clock skew between hosts can cause.
ISSUED_IN_FUTURE = "ticket issued in the future"
EXPIRED = "ticket expired"


class ReplayCacheFull(Exception):
    """More live nonces than the cache may hold: refuse rather than forget one (fail closed)."""


class ReplayCache:
    """Nonces seen within the validity window. Bounded: an entry lives until its ticket's window
    ends, and at most ``max_entries`` live at once. One per API-server process."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("the replay cache needs room for at least one nonce")
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (forget at, nonce): cheap pruning in order

    def __len__(self) -> int:
        return len(self._expiry)

    def _prune(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, nonce = heapq.heappop(self._heap)
            self._expiry.pop(nonce, None)

    def first_use(self, nonce: str, forget_at: float, now: float) -> bool:
        """Record the nonce; False if it was already used within its window."""
        self._prune(now)
        if nonce in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise ReplayCacheFull(f"{len(self._expiry)} tickets live in the replay window")
        self._expiry[nonce] = forget_at
        heapq.heappush(self._heap, (forget_at, nonce))
        return True


def check_ticket(values: list[bytes], secret: bytes) -> tuple[Ticket | None, str | None]:
    """(ticket, None) for one validly signed ticket header, else (None, why it is not trusted)."""
    if not values:
        return None, "missing ticket"
    if len(values) > 1:
        return None, "more than one ticket header"
    try:
        return decode_ticket(values[0], secret), None
    except TicketError as exc:
        return None, str(exc)


def check_binding(
    ticket: Ticket,
    request_ids: list[bytes],
    *,
    now: float,
    window_s: float,
    max_skew_s: float,
) -> str | None:
    """Why the ticket does not fit this request's headers at ``now`` (epoch s), or None.

    The deadline is not checked here: it travels as a duration (``Ticket.time_limit_s``) that
    the scheduler counts from receipt; one already spent (0) finishes the request before it
    runs, as for one whose deadline passes while it waits (refusing it here instead would run
    it unticketed when tickets are not required, with no deadline at all)."""
    if ticket.issued_at > now + max_skew_s:
        return ISSUED_IN_FUTURE
    if now > ticket.issued_at + window_s:
        return EXPIRED
    if len(request_ids) != 1:
        return "ticket needs exactly one X-Request-Id"
    if not hmac.compare_digest(request_ids[0], ticket.request_id.encode("utf-8")):
        return "ticket is for another request id"
    return None


def body_matches(ticket: Ticket, body: bytes) -> bool:
    return hmac.compare_digest(body_digest(body), ticket.body_sha256)


def salt_matches(ticket: Ticket, parsed: object) -> bool:
    """Whether the body (parsed JSON, None when it is not an object) carries the cache salt the
    ticket binds; a ticket that binds none ("") fits any body."""
    if not ticket.cache_salt:
        return True
    salt = parsed.get("cache_salt") if isinstance(parsed, dict) else None
    return isinstance(salt, str) and hmac.compare_digest(salt, ticket.cache_salt)
