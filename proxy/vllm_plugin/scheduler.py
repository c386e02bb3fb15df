"""Tier-aware scheduling for stock vLLM, loaded with ``--scheduler-cls``.

``TierScheduler`` subclasses vLLM's own ``Scheduler`` and leaves its one long ``schedule()``
loop alone: it only prepares the queues around ``super().schedule()``:

1. Deadlines: a ticketed request's deadline is the ticket's time limit (a duration) counted on
   this host's monotonic clock from when the scheduler receives it (no clock of another host
   enters it). Requests whose deadline has passed are finished with vLLM's own
   ``finish_requests`` (KV freed) and reported to the API server as aborted, so the client gets
   a proper end of response (``finish_reason: "abort"``) and no step is spent on them.
2. Preemptive priority: when a waiting request has a strictly better priority than a running
   one and cannot be admitted (no slot, or no KV room), the worst running requests (worst
   priority, then latest arrival) are preempted with vLLM's ``_preempt_request``: only as many
   as needed, and each request at most ``TIERPROXY_MAX_PREEMPTIONS`` times (no thrash).
   Preempted requests go back to the waiting queue and resume later, with prefix-cache hits.
3. Prefill share: while better-tier requests decode, the step's token budget is lowered for
   one step so that worse-tier prefill gets at most ``prefill_share * budget`` tokens; running
   decodes are ordered first so that the cap falls on the prefills, never on the decodes.

``TierScheduler`` picks ``AsyncTierScheduler`` (the ``AsyncScheduler`` flavour, GPU default)
by itself when vLLM runs with async scheduling, so one flag serves CPU and GPU.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from proxy.vllm_plugin.counters import CountersLog, PluginCounters
from proxy.vllm_plugin.requestview import (
    ADMITTABLE,
    prefill_left,
    rank,
    request_prefill_share,
    request_time_limit,
)
from proxy.vllm_plugin.settings import SchedulerSettings

# A child of vLLM's logger, so lines land in vLLM's log with its format.
logger = logging.getLogger("vllm.tierproxy.scheduler")


class TierScheduler(Scheduler):
    def __new__(cls, *args: Any, **kwargs: Any) -> TierScheduler:
        # vLLM has one --scheduler-cls flag for both modes: follow its async-scheduling choice.
        config = kwargs.get("vllm_config", args[0] if args else None)
        is_async = bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", 0))
        if cls is TierScheduler and is_async:
            cls = AsyncTierScheduler
        return super().__new__(cls)

    def __init__(
        self,
        *args: Any,
        clock: Callable[[], float] = time.monotonic,
        plugin_settings: SchedulerSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.plugin_settings = plugin_settings or SchedulerSettings.from_env()
        self.plugin_counters = PluginCounters()
        self._clock = clock  # this host's own seconds: deadlines are received as durations
        self._deadlines: list[tuple[float, str]] = []  # min-heap of (deadline, request id)
        self._plugin_preemptions: dict[str, int] = {}  # request id -> times we preempted it
        self._pending_outputs: list[EngineCoreOutput] = []
        self._pending_clients: list[int] = []
        self._counters_log = CountersLog(self.plugin_settings.stats_interval_s)
        if self.policy != SchedulingPolicy.PRIORITY:
            logger.warning(
                "tierproxy: --scheduling-policy is %s, not priority: tiers are ignored and no "
                "request is preempted for a better one (deadlines and prefill share still apply)",
                self.policy.value,
            )
        logger.info(
            "tierproxy scheduler active (%s, max_preemptions=%d, default_prefill_share=%.2f)",
            type(self).__name__,
            self.plugin_settings.max_preemptions,
            self.plugin_settings.default_prefill_share,
        )

    # ---- vLLM entry points -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        limit = request_time_limit(request)
        if limit is not None:
            heapq.heappush(self._deadlines, (self._clock() + limit, request.request_id))

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._drop_expired()
        if self.policy == SchedulingPolicy.PRIORITY:
            self._preempt_for_better_waiting()
        cap = self._apply_prefill_cap()
        try:
            output = super().schedule(throttle_prefills)
        finally:
            if cap is not None:
                self.max_num_scheduled_tokens = cap.full_budget
        if cap is not None:
            self._account_deferred(cap, output)
        self._counters_log.maybe_log(self.plugin_counters)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # Requests we finished in schedule() have no model output; report their end here, the
        # way vLLM reports its own scheduler-side finishes (e.g. grammar errors).
        for client, out in zip(self._pending_clients, self._pending_outputs, strict=True):
            eco = outputs.get(client)
            if eco is None:
                outputs[client] = eco = EngineCoreOutputs(outputs=[])
            eco.outputs.append(out)
        self._pending_outputs = []
        self._pending_clients = []
        return outputs

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._plugin_preemptions.pop(request.request_id, None)
        return finished

    # ---- 1. deadlines ------------------------------------------------------------------------

    def _drop_expired(self) -> None:
        if not self._deadlines:
            return
        now = self._clock()
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                expired.append(request)
        if len(self._deadlines) > 2 * len(self.requests) + 1024:
            # Entries of requests that finished early linger until their deadline; prune.
            self._deadlines = [e for e in self._deadlines if e[1] in self.requests]
            heapq.heapify(self._deadlines)
        if not expired:
            return
        was_running = {r.request_id for r in expired if r.status == RequestStatus.RUNNING}
        for request in self.finish_requests(
            [r.request_id for r in expired], RequestStatus.FINISHED_ABORTED
        ):
            if request.request_id in was_running:
                self.plugin_counters.deadline_drops_running += 1
            else:
                self.plugin_counters.deadline_drops_waiting += 1
            logger.debug(
                "tierproxy: %s past its deadline, finished (%d output tokens)",
                request.request_id,
                request.num_output_tokens,
            )
            self._pending_clients.append(request.client_index)
            self._pending_outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )

    # ---- 2. preemptive priority ----------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input

    def _blocks_needed(self, request: Request) -> int:
        """KV blocks the request's first step needs (its next chunk plus the sampled token)."""
        tokens = (
            request.num_computed_tokens
            + min(prefill_left(request), self.max_num_scheduled_tokens)
            + 1
        )
        return -(-tokens // self.block_size)

    def _preempt_for_better_waiting(self) -> None:
        if not self.waiting or not self.running:
            return
        worst_running = max(r.priority for r in self.running)
        candidates = sorted(
            (r for r in self.waiting if r.status in ADMITTABLE and r.priority < worst_running),
            key=rank,
        )
        if not candidates:
            return
        # Candidates come out in vLLM's admission order; each needs a slot and KV room.
        free_slots = self._free_slots()
        block_pool = self.kv_cache_manager.block_pool
        reserved_blocks = 0  # promised to candidates admitted before this one
        now = time.monotonic()
        for request in candidates:
            needed = self._blocks_needed(request)
            while free_slots <= 0 or block_pool.get_num_free_blocks() - reserved_blocks < needed:
                victim = self._pick_victim(request.priority)
                if victim is None:
                    return  # nobody worse left to preempt: vLLM's loop decides the rest
                self._preempt(victim, request, now)
                free_slots += 1
            free_slots -= 1
            reserved_blocks += needed

    def _pick_victim(self, priority: int) -> Request | None:
        bound = self.plugin_settings.max_preemptions
        eligible = [
            r
            for r in self.running
            if r.priority > priority
            and r.status == RequestStatus.RUNNING
            and self._request_blocks_can_be_freed(r)
        ]
        if not eligible:
            return None
        allowed = [r for r in eligible if self._plugin_preemptions.get(r.request_id, 0) < bound]
        if not allowed:
            self.plugin_counters.preemptions_refused += 1
            return None
        return max(allowed, key=rank)

    def _preempt(self, victim: Request, beneficiary: Request, now: float) -> None:
        self.running.remove(victim)
        self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
        self._plugin_preemptions[victim.request_id] = (
            self._plugin_preemptions.get(victim.request_id, 0) + 1
        )
        self.plugin_counters.preemptions += 1
        logger.debug(
            "tierproxy: preempted %s (priority %d, %d output tokens) for %s (priority %d)",
            victim.request_id,
            victim.priority,
            victim.num_output_tokens,
            beneficiary.request_id,
            beneficiary.priority,
        )

    # ---- 3. prefill share ----------------------------------------------------------------------

    def _apply_prefill_cap(self) -> _PrefillCap | None:
        decoding = [r for r in self.running if not r.is_prefill_chunk]
        if not decoding:
            return None
        best = min(r.priority for r in decoding)
        prefilling = [r for r in self.running if r.is_prefill_chunk]
        free_slots = max(0, self._free_slots())
        admittable = sorted((r for r in self.waiting if r.status in ADMITTABLE), key=rank)[
            :free_slots
        ]
        worse = [r for r in prefilling + admittable if r.priority > best]
        if not worse:
            return None
        budget = self.max_num_scheduled_tokens
        share = request_prefill_share(
            min(worse, key=rank), self.plugin_settings.default_prefill_share
        )
        cap = max(1, int(share * budget))
        worse_need = sum(prefill_left(r) for r in worse)
        if worse_need <= cap:
            return None
        decode_need = sum(
            max(1, r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens)
            for r in decoding
        )
        better_need = sum(prefill_left(r) for r in prefilling + admittable if r.priority <= best)
        lowered = decode_need + better_need + cap
        if lowered >= budget:
            return None
        # Decodes first, then prefills best tier first: the lowered budget then caps exactly
        # the worse tiers' prefill. (vLLM reads `running` in order; its order carries no other
        # meaning under the priority policy.)
        self.running.sort(key=lambda r: (r.is_prefill_chunk, r.is_prefill_chunk and r.priority))
        self.max_num_scheduled_tokens = lowered
        return _PrefillCap(
            full_budget=budget,
            uncapped_worse=max(0, min(worse_need, budget - decode_need - better_need)),
            worse_ids=frozenset(r.request_id for r in worse),
        )

    def _account_deferred(self, cap: _PrefillCap, output: SchedulerOutput) -> None:
        scheduled = sum(n for rid, n in output.num_scheduled_tokens.items() if rid in cap.worse_ids)
        deferred = max(0, cap.uncapped_worse - scheduled)
        if deferred:
            self.plugin_counters.capped_steps += 1
            self.plugin_counters.prefill_tokens_deferred += deferred


@dataclass(frozen=True)
class _PrefillCap:
    full_budget: int  # the step budget to restore after this step
    uncapped_worse: int  # worse-tier prefill tokens the step would have taken without the cap
    worse_ids: frozenset[str]


class AsyncTierScheduler(TierScheduler, AsyncScheduler):
    """The same policy on vLLM's ``AsyncScheduler`` (async scheduling, the GPU default)."""
