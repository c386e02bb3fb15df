"""The dispatcher: hands queued requests to backends with room, in the queue's order.

One task, owned by the app. It wakes when a request arrives, a slot frees, a backend's state
changes or the next queue deadline comes, and never busy-loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.backends.adapter_slots import LoadPlan
from proxy.backends.backend import BackendState
from proxy.backends.pool import BackendPool
from proxy.policies.types import QueuedRequest
from proxy.scheduling.early_refusal import EarlyRefusal, ServiceRates
from proxy.scheduling.queue import AdmissionQueue, QueueFull
from proxy.tasks import OwnedTask
from proxy.telemetry.metrics import ProxyMetrics

# While something waits and room depends on time (ejection backoff, ramp), look again this often.
_RECHECK_S = 0.1
# Past the end of a hold (kv_aware's) before looking again: the hold is over by then.
_HOLD_SLACK_S = 0.001


class QueueTimeoutError(Exception):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"waited {waited_s:.1f}s")
        self.waited_s = waited_s


class Unservable(Exception):
    """No backend can serve the queued request's model any more (a reload took them away)."""


@dataclass
class Lease:
    """A slot on a backend; released exactly once."""

    backend: BackendState
    tokens: float
    _dispatcher: Dispatcher
    released: bool = False
    granted_at: float = 0.0  # when the dispatcher handed it out (the backend's part starts)
    best: bool = False  # of the best tier
    reserved: bool = False  # let in past the backend's room, through the best-tier reserve
    request: QueuedRequest | None = None  # what the chooser was told it served
    adapter_plan: LoadPlan | None = None  # the adapter load it must do before it is sent
    released_at: float | None = None  # the dispatcher's clock at the release

    def backend_end(self, now: float) -> float:
        """When the backend's part ended: its release, where the relay released it at the
        backend's end while a slow client still read the rest; else ``now``."""
        return now if self.released_at is None else self.released_at

    def release(self, *, ran: bool | None = True) -> None:
        """``ran`` False: the engine did no work for it (a 4xx, a failed connection, never
        sent): the chooser keeps no trace of it. None: its client left before the engine
        answered (it may have waited in vLLM's own queue): the chooser tells."""
        if not self.released:
            self.released = True
            if self.adapter_plan is not None:  # its load never began (the loader clears it)
                self.backend.adapters.cancel(self.adapter_plan)
            pool = self._dispatcher.pool
            now = self.released_at = self._dispatcher.clock()
            pool.release(
                self.backend, self.tokens, best=self.best, request=self.request, ran=ran, now=now
            )
            # Hand the slot on now, so that a burst never sees a full queue beside a free slot.
            self._dispatcher.dispatch_ready()


@dataclass
class CheapLease:
    """A tokenizer call's place on a backend, outside its generation room; released once."""

    backend: BackendState
    pool: BackendPool
    granted_at: float = 0.0
    tenant: str = ""
    released: bool = False

    def release(self, *, ran: bool | None = True) -> None:
        if not self.released:
            self.released = True
            self.pool.release_cheap(self.backend, self.tenant)


class Dispatcher:
    def __init__(
        self,
        queue: AdmissionQueue,
        pool: BackendPool,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self._wake = asyncio.Event()
        self._held_back = False  # the last pass left requests while some backend had room
        self._task = OwnedTask("tierproxy-dispatcher")
        self.service = ServiceRates()  # per tier, for early refusal

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    def kick(self) -> None:
        self._wake.set()

    def enqueue(self, req: QueuedRequest, *, force: bool = False) -> asyncio.Future[Lease]:
        """Queue a request (QueueFull propagates) and return the future of its lease, which is
        already resolved when a backend had room: dispatch happens here, synchronously. A
        request it displaces from a full tier gets QueueFull through its own future; one whose
        tier refuses early and that would wait past the timeout gets EarlyRefusal."""
        req.waiter = asyncio.get_running_loop().create_future()
        limits = self.queue.limits(req.tier)
        if not force and self.queue.depth(req.tier) >= limits.max_queue:
            self.dispatch_ready()  # room may have appeared since (ramp, probe): use it first
        if limits.early_refusal and not force:
            self._refuse_early(req, limits.queue_timeout_s)
        displaced = self.queue.push(req, self.clock(), force=force)
        if displaced is not None:
            depth = self.queue.depth(displaced.tier)
            self._left_queue(displaced, QueueFull(displaced.tier, depth, displaced=True))
        self.dispatch_ready()
        self.metrics.queue_depth.labels(req.tier).set(self.queue.depth(req.tier))
        waiter: asyncio.Future[Lease] = req.waiter
        return waiter

    def _refuse_early(self, req: QueuedRequest, timeout_s: float) -> None:
        self.dispatch_ready()  # what can start now starts first: it is not ahead any more
        tenant_depth, tenants = self.queue.tenant_depth(req.tier, req.tenant)
        wait = self.service.predicted_wait(
            req.tier, self.queue.depth(req.tier), tenant_depth, tenants
        )
        # Time already spent (tenant limits, parsing) counts against the timeout too.
        if wait is not None and self.clock() - req.arrival_s + wait > timeout_s:
            self.metrics.slo.early_refusals.labels(req.tier).inc()
            raise EarlyRefusal(req.tier, wait)

    def withdraw(self, req: QueuedRequest) -> None:
        """The handler gave up on a request (client left): out of the queue, slot back."""
        if self.queue.remove(req):
            self._left_queue(req, None)
            return
        waiter = req.waiter
        if (
            waiter is not None
            and waiter.done()
            and not waiter.cancelled()
            and not waiter.exception()
        ):
            waiter.result().release(ran=False)  # never sent

    def refuse_unservable(self, servable: Callable[[QueuedRequest], bool]) -> int:
        """Take every queued request that no backend can serve any more out of the queue (a
        reload left none for its adapter): its client is answered at once, not at its queue
        timeout. How many."""
        gone = [req for req in self.queue.queued() if not servable(req)]
        for req in gone:
            self.refuse(req, Unservable(req.model))
        return len(gone)

    def refuse(self, req: QueuedRequest, error: Exception) -> bool:
        """Take a queued request out and answer its handler ``error`` now (a reload refused
        it); False when it is no longer queued."""
        if not self.queue.remove(req):
            return False
        self._left_queue(req, error)
        return True

    def move(self, req: QueuedRequest, tier: str) -> bool:
        """A queued request to ``tier`` (a reload moved its tenant there): it keeps its
        deadline and takes its place by the new tier's order; False when no longer queued."""
        old = req.tier
        if old == tier or not self.queue.remove(req):
            return False
        req.tier = tier  # pushed as if it entered ``tier`` when it would keep its deadline
        self.queue.push(req, req.deadline_s - self.queue.limits(tier).queue_timeout_s, force=True)
        for changed in (old, tier):
            self.metrics.queue_depth.labels(changed).set(self.queue.depth(changed))
        return True

    def _left_queue(self, req: QueuedRequest, error: Exception | None) -> None:
        """``req`` is out of the queue without a lease: the chooser told, its wait and its
        tier's depth recorded, its handler (if it still waits) answered ``error``."""
        self.pool.chooser.left(req)
        self.metrics.queue_wait.labels(req.tier).observe(self.clock() - req.arrival_s)
        self.metrics.queue_depth.labels(req.tier).set(self.queue.depth(req.tier))
        if error is not None and req.waiter is not None and not req.waiter.done():
            req.waiter.set_exception(error)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            self.dispatch_ready()
            await self._sleep()

    async def _sleep(self) -> None:
        timeout: float | None = None
        deadline = self.queue.next_deadline()
        if deadline is not None:
            timeout = max(0.0, deadline - self.clock())
        if len(self.queue) and not self._room_for_some(self.clock()):
            timeout = _RECHECK_S if timeout is None else min(timeout, _RECHECK_S)
        elif (
            self._held_back and (ends := self.pool.chooser.next_hold_end(self.clock())) is not None
        ):
            # Held for a full backend while another has room: a slot freed there wakes this
            # loop; else the hold's end does.
            ends += _HOLD_SLACK_S
            timeout = ends if timeout is None else min(timeout, ends)
        patience = self._patience_end()
        if patience is not None:  # a request spared a wanted adapter: it may load it then
            ends = max(0.0, patience - self.clock()) + _HOLD_SLACK_S
            timeout = ends if timeout is None else min(timeout, ends)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    def dispatch_ready(self) -> int:
        """Expire what waited too long, then dispatch while some backend has room."""
        now = self.clock()
        touched: set[str] = set()
        for req in self.queue.expire(now):
            self._left_queue(req, QueueTimeoutError(now - req.arrival_s))
        dispatched = 0
        self._held_back = False
        for state in self.pool.states.values():  # who waits for an adapter slot: seen anew
            state.adapters.new_pass(self._adapter_demand)
        self._note_due(now)
        # No pop while no backend has a free slot: every head would be refused, one by one.
        while len(self.queue) and self._room_for_some(now):
            popped = self._pop_chosen(now)
            if popped is None:
                self._held_back = True  # room, but every request waits for another backend
                break
            req, backend = popped
            touched.add(req.tier)
            tokens = float(req.prompt_tokens + req.expected_output)
            best = req.tier in self.pool.best_tiers
            reserved = best and self.pool.room(backend, now) < 1.0
            plan = self.pool.acquire(
                backend, tokens, request=req, best=best, reserved=reserved, now=now
            )
            self.service.dispatched(req.tier, now, self.queue.depth(req.tier))
            lease = Lease(
                backend, tokens, self, granted_at=now, best=best, reserved=reserved, request=req
            )
            lease.adapter_plan = plan
            if req.waiter is None or req.waiter.done():
                lease.release(ran=False)  # its handler is gone: never sent
                continue
            self.metrics.queue_wait.labels(req.tier).observe(now - req.arrival_s)
            req.waiter.set_result(lease)
            dispatched += 1
        for tier in touched:
            self.metrics.queue_depth.labels(tier).set(self.queue.depth(tier))
        return dispatched

    def _pop_chosen(self, now: float) -> tuple[QueuedRequest, BackendState] | None:
        """The next request by policy that some backend takes, with the backend chosen for it.
        The pick that let it out of the queue is the one used: a pick has effects (an adapter
        wait noted, a hold begun), so a second one may differ. It once returned None there: an
        AssertionError, a 500, and the request popped but never leased (its client waited out
        its timeout)."""
        chosen: dict[QueuedRequest, BackendState] = {}  # by request: whatever pop tried

        def taken(req: QueuedRequest) -> bool:
            backend = self._choose(req, now)
            if backend is not None:
                chosen[req] = backend
            return backend is not None

        req = self.queue.pop(taken)
        return (req, chosen[req]) if req is not None else None

    def _note_due(self, now: float) -> None:
        """Due adapter requests are offered first, so that the engines where they wait for a
        slot know it before anyone else's request of this pass joins or starts an adapter
        there (proxy.backends.adapter_rules, "Due")."""
        if not self.pool.adapters:
            return
        policy, best_tiers = self.pool.adapter_policy, self.pool.best_tiers
        for req in list(self.queue.heads()):
            if req.model in self.pool.adapters and policy.due(req.arrival_s, req.deadline_s, now):
                self.pool.note_adapter_wait(req, req.tier in best_tiers, now)

    def _adapter_demand(self, adapter: str) -> int | None:
        """The best tier rank among the tenants whose next queued request wants ``adapter``."""
        ranks = self.pool.adapter_policy.ranks
        return min((ranks.get(t, 0) for t in self.queue.tiers_wanting(adapter)), default=None)

    def _patience_end(self) -> float | None:
        """When the first request that waits to spare a wanted adapter stops waiting."""
        ends = [s.adapters.patience_ends for s in self.pool.states.values()]
        return min((e for e in ends if e is not None), default=None)

    def _room_for_some(self, now: float) -> bool:
        """Some backend has a free slot, or a best-tier request waits and some reserve is free."""
        if self.pool.any_room(now):
            return True
        best = self.pool.best_tiers
        return any(self.queue.depth(t) for t in best) and self.pool.any_room(now, best=True)

    def _choose(self, req: QueuedRequest, now: float) -> BackendState | None:
        tokens = float(req.prompt_tokens + req.expected_output)
        best = req.tier in self.pool.best_tiers
        return self.pool.choose(req.model, tokens, now, request=req, best=best)
