"""The one connection to Redis: every call under a timeout, Lua scripts by EVALSHA (loaded again
after NOSCRIPT: a restarted Redis has forgotten them), and the up/down state the callers fall
back on. While Redis is down a probe task pings it; the first answer brings shared state back.

Waiting for a pooled connection is kept apart from the call: a call first takes one of
``max_connections`` slots (within ``pool_wait_s``; past it ``SharedStateBusy``, Redis stays up),
then has its whole ``call_timeout_s``. Only the call's own failures count towards "down": a
burst larger than the pool no longer flips a healthy Redis to down.

A script that fails on a value it did not expect (``WRONGTYPE``, a Lua error) is Redis
answering, not Redis down: ``SharedStateBadValue`` for that call alone, never "down" for every
tenant. The scripts check their keys themselves and answer per tenant; this is the net below.

Every key carries the format version (``{key_prefix}:v2:...``): replicas of two versions in a
rolling upgrade never read each other's keys (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.config.shared_state import SharedState
from proxy.tasks import OwnedTask

log = logging.getLogger("tierproxy.replicas")

T = TypeVar("T")

# At most one "Redis is down" warning this often (a flapping Redis must not flood the log).
WARN_EVERY_S = 10.0
# A lost connection means down at once; a slow answer only after this many in a row (one slow
# call is decided locally, the next ones still try Redis).
DOWN_AFTER_TIMEOUTS = 3
# Connections past max_connections: the room's subscriber holds one for good (proxy.replicas.room).
SUBSCRIBER_CONNECTIONS = 1
# The format of every key and value this code writes; bumped when one changes, so that replicas
# of two versions during a rolling upgrade keep apart instead of misreading each other.
KEY_FORMAT = "v2"
# At most this many keys remembered for the "bad key" warnings' rate limit.
WARNED_KEYS = 1024


class SharedStateDown(Exception):
    """Redis did not answer in time (or at all): the caller decides without it."""


class SharedStateBusy(SharedStateDown):
    """No connection came free within ``pool_wait_s``: decided without Redis, which is not
    marked down (it may be perfectly healthy; this process has more calls than connections)."""


class SharedStateBadValue(SharedStateDown):
    """A script met a value it cannot read (a key of another type or format): this call is
    decided without Redis, which stays up for every other tenant."""


def may_have_run(failure: BaseException) -> bool:
    """Whether a failed call's script may still have run (or run later) in Redis: a lost
    connection or a timeout may come after Redis read it; a call that found no connection was
    never sent, and a bad value was Redis's own answer (nothing written)."""
    return isinstance(failure, SharedStateDown) and not isinstance(
        failure, SharedStateBusy | SharedStateBadValue
    )


class Script:
    """A Lua script and its SHA1, as EVALSHA names it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class SharedStore:
    def __init__(
        self,
        cfg: SharedState,
        registry: CollectorRegistry | None = None,
        *,
        redis: Redis | None = None,
    ) -> None:
        self.cfg = cfg
        # A bounded pool: a burst of requests queues for a connection instead of opening
        # hundreds at once (on ``_slots``, where the wait is timed apart from the call). The
        # pool never makes a call wait itself: it has a connection per slot, plus the
        # subscriber's. The client's own retries would stretch a call past call_timeout_s.
        self._slots = asyncio.Semaphore(cfg.max_connections)
        pool = BlockingConnectionPool.from_url(
            cfg.url,
            max_connections=cfg.max_connections + SUBSCRIBER_CONNECTIONS,
            timeout=cfg.pool_wait_s + cfg.call_timeout_s,
            socket_timeout=cfg.call_timeout_s,
            # Calls stay bounded by call_timeout_s; warm() may take longer to connect.
            socket_connect_timeout=max(1.0, cfg.call_timeout_s),
            retry=Retry(NoBackoff(), 0),
        )
        self.redis = redis or Redis(connection_pool=pool)
        self.up = True  # optimistic: the first failure says otherwise
        self.fallback = Gauge(
            "tierproxy_shared_state_fallback",
            "1 while Redis is unreachable and this process decides without shared state",
            registry=registry,
        )
        self.pool_timeouts = Counter(
            "tierproxy_shared_state_pool_timeouts",
            "Redis calls that found no free connection within pool_wait_s (decided without"
            " Redis; Redis not marked down)",
            registry=registry,
        )
        self.bad_keys = Counter(
            "tierproxy_shared_state_bad_keys",
            "Redis keys found holding a value of the wrong type or format, by kind (quota:"
            " its tenant decided without Redis; limit, ledger: reset; script: a call failed)",
            ["kind"],
            registry=registry,
        )
        self._warned_keys: dict[str, float] = {}
        self._probe = OwnedTask("tierproxy-shared-probe")
        self._warned_at = -WARN_EVERY_S
        self._timeouts = 0  # consecutive calls that timed out
        self.on_up: list[Callable[[], None]] = []  # called when Redis answers again
        self._orphans: set[asyncio.Future[Any]] = set()  # run_or_undo's, their caller gone

    def key(self, *parts: str) -> str:
        return ":".join((self.cfg.key_prefix, KEY_FORMAT, *parts))

    def bad_key(self, kind: str, key: str, action: str) -> None:
        """A key of the wrong type or format, met by a script: counted, and logged with its name
        (at most once per key every ``WARN_EVERY_S``; a key name holds no secret)."""
        self.bad_keys.labels(kind).inc()
        now = time.monotonic()
        if now - self._warned_keys.get(key, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        if len(self._warned_keys) >= WARNED_KEYS:
            self._warned_keys.clear()
        self._warned_keys[key] = now
        log.warning("shared state: bad value at Redis key %s (%s): %s", key, kind, action)

    async def close(self) -> None:
        await self._probe.stop()
        if self._orphans:  # each bounded by the call timeout; their undo runs as they end
            await asyncio.gather(*self._orphans, return_exceptions=True)
        await self.redis.aclose()

    async def call(self, op: Callable[[Redis], Awaitable[T]]) -> T:
        """``op`` on a connection of its own, under the call timeout; a failure of the call
        marks Redis down (a lost connection at once, timeouts after a few in a row) and raises
        ``SharedStateDown``. No connection free within ``pool_wait_s``: ``SharedStateBusy``."""
        if not self.up:
            raise SharedStateDown("redis is down")
        try:
            async with asyncio.timeout(self.cfg.pool_wait_s):
                await self._slots.acquire()
        except TimeoutError:
            self.pool_timeouts.inc()
            raise SharedStateBusy(
                f"no Redis connection free within {self.cfg.pool_wait_s} s"
            ) from None
        try:
            async with asyncio.timeout(self.cfg.call_timeout_s):
                result = await op(self.redis)
        except ResponseError as exc:
            if not _bad_value(exc):
                self._failed(exc)
            self.bad_key("script", "(a script's key)", str(exc).splitlines()[0][:200])
            raise SharedStateBadValue(str(exc)) from exc
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
        finally:
            self._slots.release()
        self._timeouts = 0
        return result

    def _failed(self, exc: BaseException) -> NoReturn:
        slow = isinstance(exc, TimeoutError | RedisTimeoutError)
        self._timeouts = self._timeouts + 1 if slow else DOWN_AFTER_TIMEOUTS
        if self._timeouts >= DOWN_AFTER_TIMEOUTS:
            self.mark_down(exc)
        raise SharedStateDown(str(exc) or type(exc).__name__) from exc

    async def warm(self) -> None:
        """Open the pool's connections now, not in the first burst of requests (opening
        sixteen at once can take longer than a call may)."""
        async with asyncio.timeout(max(1.0, 4 * self.cfg.call_timeout_s)):
            await asyncio.gather(*(self.redis.ping() for _ in range(self.cfg.max_connections)))

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        async def evalsha(redis: Redis) -> Any:
            try:
                return await redis.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await redis.script_load(script.source)
                return await redis.evalsha(script.sha, len(keys), *keys, *args)

        return await self.call(evalsha)

    async def run_or_undo(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[Any],
        undo: Callable[[Any], None],
        lost: Callable[[], None] | None = None,
    ) -> Any:
        """``run`` for a script that takes something (a reservation, a slot). A caller cancelled
        while it runs (the client left mid-admission) does not leave it taken: the call goes on
        (within its timeout) and ``undo`` gets its answer, to give back what it took. If the
        call then fails once sent (a stall past the call timeout: Redis may still run it when
        it wakes), ``lost`` is told, to take it back by its id when Redis answers."""
        call = asyncio.ensure_future(self.run(script, keys, args))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._orphans.add(call)
            call.add_done_callback(lambda done: self._undo(done, undo, lost))
            raise

    def _undo(
        self,
        call: asyncio.Future[Any],
        undo: Callable[[Any], None],
        lost: Callable[[], None] | None,
    ) -> None:
        self._orphans.discard(call)
        if call.cancelled():
            return
        failure = call.exception()
        try:
            if failure is None:
                undo(call.result())
            elif lost is not None and may_have_run(failure):
                lost()
        except Exception:  # a callback: nothing above it would log the failure
            log.exception("giving back an orphaned shared-state reservation failed")

    async def listen(self, channel: str, heard: Callable[[Any], None], what: str) -> None:
        """Call ``heard`` with each message published on ``channel``, for ever: subscribed
        again (after ``probe_interval_s``) whenever the connection fails; every wait bounded."""
        while True:
            pubsub = self.redis.pubsub()
            try:
                async with asyncio.timeout(self.cfg.call_timeout_s * 4):
                    await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.cfg.lease_ttl_s
                    )
                    if message is not None:
                        heard(message.get("data"))
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("%s: %s; subscribing again", what, exc)
                await asyncio.sleep(self.cfg.probe_interval_s)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(self.cfg.call_timeout_s):
                        # Typed from redis 8.2 on, untyped before: the cast fits both.
                        close = cast(Callable[[], Awaitable[None]], pubsub.aclose)
                        await close()

    def mark_down(self, exc: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        self._timeouts = 0
        self.fallback.set(1)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            action = "local limits" if self.cfg.on_failure == "local" else "refusing requests"
            log.warning("shared state unreachable (%s): %s until it answers", exc, action)
        # Only one probe: it runs while down, and this is the only way down.
        self._probe.start(self._wait_for_redis)

    async def _wait_for_redis(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            # The pool's connections went down with the old server: drop them all (each would
            # fail once and send the process back into fallback), then open them again.
            await self.redis.connection_pool.disconnect()
            try:
                await self.warm()
            except (RedisError, OSError, TimeoutError):
                continue
            self._timeouts = 0
            self.up = True
            self.fallback.set(0)
            log.warning("shared state reachable again: global limits resume")
            for callback in self.on_up:
                callback()
            return


def _bad_value(exc: ResponseError) -> bool:
    """A script's own failure on a value (not READONLY, OOM, BUSY: Redis's state)."""
    text = str(exc)
    return text.startswith("WRONGTYPE") or "user_script" in text
