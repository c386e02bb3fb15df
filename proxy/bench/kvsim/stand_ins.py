"""What stands in for the server around the proxy's real scheduling in the simulator: the
future a dispatched request's handler waits on, the KV index fed by the simulated engine, and
one request's record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.backends.kvindex import KvIndex
from proxy.scheduling.dispatch import Lease
from proxy.scheduling.queue import QueueFull


def note(out: list[tuple[bool, int]], stored: bool, block: int) -> None:
    out.append((stored, block))


class SimIndex(KvIndex):
    """The proxy's index of one engine, fed the engine's blocks by their proxy hash directly
    (the sim's engine hashes blocks as the proxy does)."""

    def put(self, block: int) -> None:
        self._put(block, block)
        self._bound()


@dataclass
class Record:
    tenant: str
    tier: str
    kind: str
    sent: float
    prompt: int
    ttft: float | None = None
    status: int = 0  # 200, 429 (queue full), 503 (queue timeout)
    backend: str = ""
    computed: int | None = None  # its prompt less the hit at its first admission (None: not run)


class Waiter:
    """What the dispatcher resolves in place of the server's future."""

    def __init__(self, on_lease: Callable[[Lease], None], on_error: Callable[[int], None]):
        self._done = False
        self.on_lease, self.on_error = on_lease, on_error

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, lease: Lease) -> None:
        self._done = True
        self.on_lease(lease)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.on_error(429 if isinstance(exc, QueueFull) else 503)
