"""Loads and unloads LoRA adapters on a backend (vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), each call within
the backend's ``adapter_load_timeout_s``. The plan comes from the pool at dispatch
(``proxy.backends.adapter_slots``); requests that reach the backend while its load runs wait for
the same load. A load runs in a task of its own: a client that leaves does not cancel it; the loader
owns those tasks, and ``stop()`` (the proxy's shutdown) cancels and awaits them all."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from proxy.backends.adapter_slots import LoadPlan
from proxy.backends.backend import BackendState
from proxy.config.adapters import Adapter

log = logging.getLogger("tierproxy.adapters")

# vLLM answers a load of an adapter it already lists with 400 ("... has already been loaded").
_ALREADY = "already been loaded"
_STOPPING = "the proxy is stopping"
_TOO_LATE = "still loading when the request's queue timeout ran out"
# A load that failed is not tried again on that backend for this long (the same path: a reload
# that fixes the path tries at once). Without it every request for a broken adapter gave up an
# idle adapter of another tenant to make room for a load that fails again.
FAILED_LOAD_HOLD_S = 30.0


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AdapterLoadFailed(Exception):
    """``retry_after_s``: when a retry may do better (the rest of a failed load's hold)."""

    def __init__(self, adapter: str, backend: str, reason: str, retry_after_s: float = 1.0):
        super().__init__(f"adapter {adapter!r} could not be loaded on {backend}: {reason}")
        self.adapter = adapter
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class AdapterEvents:
    """What the loader reports (the metrics, proxy.telemetry.adapter_metrics)."""

    loaded: Callable[[str, str, float], None] = lambda backend, adapter, seconds: None
    unloaded: Callable[[str, str], None] = lambda backend, adapter: None
    failed: Callable[[str, str, str], None] = lambda backend, adapter, reason: None
    unload_failed: Callable[[str, str, str], None] = lambda backend, adapter, reason: None


@dataclass
class AdapterLoader:
    session: Callable[[], aiohttp.ClientSession]
    catalogue: Callable[[], Mapping[str, Adapter]]
    events: AdapterEvents = field(default_factory=AdapterEvents)
    clock: Callable[[], float] = time.monotonic
    # (backend url, adapter) -> the load under way (its result: None loaded, else why not);
    # each ends within adapter_load_timeout_s and forgets itself.
    _loads: dict[tuple[str, str], asyncio.Task[str | None]] = field(default_factory=dict)
    # Every load task not yet ended, whatever its key: what stop() cancels.
    _tasks: set[asyncio.Task[str | None]] = field(default_factory=set)
    _stopped: bool = False
    # (backend url, adapter, path) -> when its load last failed; (backend url, tenant) -> when
    # a load that tenant asked for last failed there.
    _failed_at: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _tenant_failed_at: dict[tuple[str, str], float] = field(default_factory=dict)

    async def ready(
        self,
        state: BackendState,
        adapter: str,
        plan: LoadPlan | None,
        deadline: float | None = None,
    ) -> None:
        """Returns once ``adapter`` is loaded on ``state`` (at once when it was held already);
        AdapterLoadFailed when the load this request made or waits for failed, or was not done
        by ``deadline`` (on the loader's clock: the end of the request's queue time, which a
        load never stretches; the load itself goes on, within its own timeout, for the
        requests after it)."""
        key = (state.cfg.url, adapter)
        if plan is not None:
            if self._stopped:  # shutting down: nothing new starts
                state.adapters.cancel(plan)
                raise AdapterLoadFailed(adapter, state.label, _STOPPING)
            held_back = self._recently_failed(state, adapter) or self._tenant_held(state, plan)
            if held_back is not None:  # nothing given up for a load that would fail again
                state.adapters.cancel(plan)
                raise AdapterLoadFailed(adapter, state.label, *held_back)
            task = asyncio.create_task(self._run(state, plan), name=f"load {adapter}")
            self._loads[key] = task
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._forget(key, t))
        else:
            found = self._loads.get(key)
            if found is None:
                return
            task = found
        wait_s = None if deadline is None else max(0.0, deadline - self.clock())
        try:
            async with asyncio.timeout(wait_s):
                failure = await asyncio.shield(task)
        except TimeoutError:
            raise AdapterLoadFailed(adapter, state.label, _TOO_LATE) from None
        except asyncio.CancelledError:
            # The load was stopped under this waiter (shutdown), not the waiter itself.
            if task.cancelled() and not _being_cancelled():
                raise AdapterLoadFailed(adapter, state.label, _STOPPING) from None
            raise
        if failure is not None:
            held = self._recently_failed(state, adapter)  # held back from now on: how long
            retry_s = held[1] if held is not None else 1.0
            raise AdapterLoadFailed(adapter, state.label, failure, retry_s)

    def _path_key(self, state: BackendState, adapter: str) -> tuple[str, str, str] | None:
        found = self.catalogue().get(adapter)
        return None if found is None else (state.cfg.url, adapter, found.path)

    def _recently_failed(self, state: BackendState, adapter: str) -> tuple[str, float] | None:
        """Why a load of ``adapter`` is held back here, and for how much longer; None: it
        is not."""
        key = self._path_key(state, adapter)
        if key is None or key not in self._failed_at:
            return None
        ago = self.clock() - self._failed_at[key]
        if ago >= FAILED_LOAD_HOLD_S:
            del self._failed_at[key]
            return None
        hold = FAILED_LOAD_HOLD_S
        why = f"its last load here failed {ago:.0f} s ago; tried again {hold:.0f} s after it"
        return why, hold - ago

    def _tenant_held(self, state: BackendState, plan: LoadPlan) -> tuple[str, float] | None:
        """A load that would give up another tenant's adapter, for a tenant whose load failed
        here within the hold: held back too, so that a tenant's broken adapters, each a new
        name, cost other tenants at most one unload per backend per hold (red team R3: each
        of three broken adapters unloaded a peer's adapter, reloaded at its next request)."""
        at = self._tenant_failed_at.get((state.cfg.url, plan.tenant))
        if at is None or not plan.others:
            return None
        ago = self.clock() - at
        if ago >= FAILED_LOAD_HOLD_S:
            del self._tenant_failed_at[(state.cfg.url, plan.tenant)]
            return None
        why = f"a load of this tenant's failed here {ago:.0f} s ago: none may unload another's"
        return why, FAILED_LOAD_HOLD_S - ago

    async def stop(self) -> None:
        """Cancel every load under way and wait for them (their slots put back as before the
        load); later loads are refused. Idempotent."""
        self._stopped = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, key: tuple[str, str], task: asyncio.Task[str | None]) -> None:
        self._tasks.discard(task)
        if self._loads.get(key) is task:
            del self._loads[key]

    async def _run(self, state: BackendState, plan: LoadPlan) -> str | None:
        """The plan's unload then load; the reason it failed, None when it was loaded."""
        try:
            return await self._carry_out(state, plan)
        except asyncio.CancelledError:
            # Stopped midway: neither held nor given up for sure; the next /v1/models says.
            if plan.unload is not None:
                state.adapters.unload_done(plan.unload)
            state.adapters.load_done(plan.load, ok=False)
            raise

    async def _carry_out(self, state: BackendState, plan: LoadPlan) -> str | None:
        slots, label = state.adapters, state.label
        if plan.unload is not None:
            status, text = await self._post(state, "unload", {"lora_name": plan.unload})
            done = status in (200, 404)  # 404: it was gone already
            slots.unload_done(plan.unload, ok=done)
            if not done:  # still counted as held: loading now could pass max_loras
                slots.load_done(plan.load, ok=False)
                why = f"HTTP {status}" if status else text
                self.events.unload_failed(label, plan.unload, why)
                log.warning(
                    "unloading adapter %s from %s failed: %s%s (%s not loaded)",
                    *(plan.unload, label, why, f" {text[:200]}" if status else "", plan.load),
                )
                # The other adapter is not named: it may be another tenant's.
                return f"no adapter slot was freed on the backend: the unload {why}"
            self.events.unloaded(label, plan.unload)
        adapter = self.catalogue().get(plan.load)
        if adapter is None:  # a reload removed it since dispatch
            slots.load_done(plan.load, ok=False)
            return "not in the configuration any more"
        started = self.clock()
        status, text = await self._post(
            state, "load", {"lora_name": plan.load, "lora_path": adapter.path}
        )
        ok = status == 200 or (status == 400 and _ALREADY in text)
        slots.load_done(plan.load, ok=ok)
        if ok:
            self.events.loaded(label, plan.load, self.clock() - started)
            return None
        reason = f"HTTP {status}" if status else text
        if not _being_cancelled():
            self._failed_at[(state.cfg.url, plan.load, adapter.path)] = self.clock()
            self._tenant_failed_at[(state.cfg.url, plan.tenant)] = self.clock()
        self.events.failed(label, plan.load, reason)
        log.warning("loading adapter %s on %s failed: %s %s", plan.load, label, reason, text[:200])
        return reason

    async def _post(self, state: BackendState, verb: str, body: dict[str, str]) -> tuple[int, str]:
        """(status, text) of one call; (0, why) when it got no answer in time."""
        url = f"{state.cfg.url}/v1/{verb}_lora_adapter"
        try:
            async with asyncio.timeout(state.cfg.adapter_load_timeout_s):
                async with self.session().post(url, json=body) as resp:
                    return resp.status, (await resp.text())[:1000]
        except TimeoutError:
            return 0, "timed out"
        except (aiohttp.ClientError, OSError) as exc:
            return 0, f"no answer ({type(exc).__name__})"
