"""The plugin's scheduler on vLLM's real Scheduler class, built on the CPU without a model server.

The model runner is faked (one sampled token per request whose prefill is done), as in vLLM's own
tests/v1/core; everything else (queues, KV cache manager, preemption, finishing) is vLLM's code.
Each policy test also runs stock ``Scheduler`` on the same scenario where that shows the plugin
is what makes the difference.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from proxy.ticket import XARG_PREFILL_SHARE, XARG_TIME_LIMIT, XARG_TRUSTED, Ticket  # noqa: E402
from proxy.vllm_plugin.counters import PluginCounters  # noqa: E402
from proxy.vllm_plugin.middleware import rewrite_body  # noqa: E402
from proxy.vllm_plugin.scheduler import AsyncTierScheduler, TierScheduler  # noqa: E402
from proxy.vllm_plugin.settings import SchedulerSettings  # noqa: E402
from tests.helpers.clock import FakeClock  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402

BLOCK = 16
HIGH, LOW = 0, 10
TOKEN = 7
EPOCH = 1_000_000.0  # the scheduler's own clock (deadlines arrive as durations)

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from proxy.tools.tiny_model import make_tiny_model

    return make_tiny_model(REPO / ".tierproxy" / "tiny-model")  # idempotent, config only read


def make_scheduler(
    model_dir: Path,
    cls: type[Scheduler] = TierScheduler,
    *,
    max_num_seqs: int = 4,
    budget: int = 512,
    num_blocks: int = 1000,
    clock: FakeClock | None = None,
    max_preemptions: int = 2,
    policy: Literal["fcfs", "priority"] = "priority",
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=2048,
        enable_chunked_prefill=True,
        policy=policy,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=2048
    )
    cache_config = CacheConfig(block_size=BLOCK)
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
                ),
            )
        ],
    )
    kwargs: dict[str, Any] = {
        "vllm_config": vllm_config,
        "kv_cache_config": kv_cache_config,
        "structured_output_manager": StructuredOutputManager(vllm_config),
        "block_size": BLOCK,
        "log_stats": True,
    }
    if issubclass(cls, TierScheduler):
        kwargs["clock"] = clock or FakeClock(EPOCH)
        kwargs["plugin_settings"] = SchedulerSettings(
            max_preemptions=max_preemptions, stats_interval_s=0.0
        )
    return cls(**kwargs)


def counters_of(scheduler: Scheduler) -> PluginCounters:
    assert isinstance(scheduler, TierScheduler)
    return scheduler.plugin_counters


_ids = iter(range(1_000_000))


def make_request(
    prompt_len: int,
    max_tokens: int,
    priority: int,
    *,
    arrival: float | None = None,
    time_limit: float | None = None,
    share: float | None = None,
    extra_args: dict[str, Any] | None = None,
) -> Request:
    extra: dict[str, Any] = {XARG_TRUSTED: 1, **(extra_args or {})}
    if time_limit is not None:
        extra[XARG_TIME_LIMIT] = time_limit
    if share is not None:
        extra[XARG_PREFILL_SHARE] = share
    n = next(_ids)
    return Request(
        request_id=f"r{n}",
        # Distinct prompts: no accidental prefix-cache sharing between requests.
        prompt_token_ids=[(n * 31 + i) % 997 + 3 for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
        pooling_params=None,
        priority=priority,
        arrival_time=arrival if arrival is not None else float(n),
        block_hasher=_HASHER,
    )


class Run:
    """Drives a scheduler step by step with a fake model runner; records what clients see."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, FinishReason] = {}
        self.ever_scheduled: set[str] = set()

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.ever_scheduled.update(out.num_scheduled_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.s.requests[rid]
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        for eco in self.s.update_from_output(out, runner).values():
            for o in eco.outputs:
                self.tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = o.finish_reason
        return out

    def steps(self, n: int) -> Iterator[SchedulerOutput]:
        for _ in range(n):
            yield self.step()

    def until_done(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.s.has_requests():
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def fill_with_low(run: Run, n: int = 4, max_tokens: int = 40) -> list[Request]:
    lows = [make_request(32, max_tokens, LOW) for _ in range(n)]
    for r in lows:
        run.s.add_request(r)
    list(run.steps(3))  # prefill + a couple of decode steps: all running, decoding
    assert all(r.status == RequestStatus.RUNNING for r in lows)
    return lows


# ---- 1. preemptive priority ------------------------------------------------------------------


def test_high_preempts_worst_low_only_as_many_as_needed(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir))
    lows = fill_with_low(run)
    high = make_request(32, 5, HIGH)
    run.s.add_request(high)
    out = run.step()
    assert high.request_id in out.num_scheduled_tokens  # admitted in the very next step
    latest_low = max(lows, key=lambda r: r.arrival_time)
    assert out.preempted_req_ids == {latest_low.request_id}
    assert latest_low.status == RequestStatus.PREEMPTED
    assert sum(r.status == RequestStatus.RUNNING for r in lows) == 3
    assert counters_of(run.s).preemptions == 1


def test_stock_scheduler_makes_high_wait(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, Scheduler))
    fill_with_low(run)
    high = make_request(32, 5, HIGH)
    run.s.add_request(high)
    for out in run.steps(5):
        assert high.request_id not in out.num_scheduled_tokens
        assert not out.preempted_req_ids


def test_preempted_requests_complete_with_full_output(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir))
    lows = fill_with_low(run, max_tokens=30)
    highs = [make_request(20, 8, HIGH) for _ in range(2)]
    for r in highs:
        run.s.add_request(r)
    run.until_done()
    for r in lows + highs:
        assert run.finish[r.request_id] == FinishReason.LENGTH
        assert r.sampling_params is not None and r.sampling_params.max_tokens is not None
        assert run.tokens[r.request_id] == [TOKEN] * r.sampling_params.max_tokens
    assert counters_of(run.s).preemptions == 2
    assert run.s.kv_cache_manager.usage == 0.0


def test_equal_or_worse_priority_preempts_nothing(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir))
    fill_with_low(run)
    same = make_request(32, 5, LOW)
    run.s.add_request(same)
    out = run.step()
    assert same.request_id not in out.num_scheduled_tokens
    assert not out.preempted_req_ids


def test_preemptions_per_request_are_bounded(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, max_num_seqs=1, max_preemptions=1))
    low = make_request(32, 200, LOW)
    run.s.add_request(low)
    list(run.steps(2))
    for _ in range(3):  # a stream of highs, one at a time
        high = make_request(16, 3, HIGH)
        run.s.add_request(high)
        while high.request_id not in run.finish:
            run.step()
        list(run.steps(2))  # low resumes
    counters = counters_of(run.s)
    assert counters.preemptions == 1  # once, then the bound protects it
    assert counters.preemptions_refused >= 1
    assert low.num_preemptions == 1


def test_preempts_for_kv_room_when_a_slot_is_free(model_dir: Path) -> None:
    # 4 lows hold 28 of 33 usable blocks: a free slot, but no KV room for a 200-token prompt.
    run = Run(make_scheduler(model_dir, max_num_seqs=8, num_blocks=34))
    lows = [make_request(100, 40, LOW) for _ in range(4)]
    for r in lows:
        run.s.add_request(r)
    list(run.steps(3))
    high = make_request(200, 4, HIGH)
    run.s.add_request(high)
    out = run.step()
    assert high.request_id in out.num_scheduled_tokens
    assert out.preempted_req_ids  # made room
    run.until_done()
    assert all(run.finish[r.request_id] == FinishReason.LENGTH for r in [*lows, high])


# ---- 2. prefill share ---------------------------------------------------------------------------


def _long_low_behind_decoding_highs(run: Run, share: float | None) -> tuple[Request, list[Request]]:
    highs = [make_request(16, 100, HIGH) for _ in range(2)]
    for r in highs:
        run.s.add_request(r)
    list(run.steps(2))
    low = make_request(1500, 4, LOW, share=share)
    run.s.add_request(low)
    return low, highs


def test_worse_tier_prefill_capped_while_better_tier_decodes(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, budget=512))
    low, highs = _long_low_behind_decoding_highs(run, share=0.2)
    chunks = []
    while low.is_prefill_chunk or low.num_computed_tokens == 0:
        out = run.step()
        for h in highs:
            assert out.num_scheduled_tokens[h.request_id] == 1  # decodes never skipped
        chunks.append(out.num_scheduled_tokens.get(low.request_id, 0))
    assert max(chunks) <= int(0.2 * 512)
    assert sum(chunks) == 1500
    counters = counters_of(run.s)
    assert counters.prefill_tokens_deferred > 0
    assert run.s.max_num_scheduled_tokens == 512  # restored after every step


def test_stock_prefill_takes_the_whole_step(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, Scheduler, budget=512))
    low, _ = _long_low_behind_decoding_highs(run, share=0.2)
    out = run.step()
    assert out.num_scheduled_tokens[low.request_id] == 510


def test_share_from_ticket_and_default(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, budget=512))
    low, _ = _long_low_behind_decoding_highs(run, share=0.5)
    assert run.step().num_scheduled_tokens[low.request_id] == 256
    run2 = Run(make_scheduler(model_dir, budget=512))
    low2, _ = _long_low_behind_decoding_highs(run2, share=None)  # no ticket share: 0.2
    assert run2.step().num_scheduled_tokens[low2.request_id] == int(0.2 * 512)


def test_no_cap_without_better_tier_decoding(model_dir: Path) -> None:
    run = Run(make_scheduler(model_dir, budget=512))
    low = make_request(1500, 4, LOW, share=0.2)
    run.s.add_request(low)
    assert run.step().num_scheduled_tokens[low.request_id] == 512
    assert counters_of(run.s).prefill_tokens_deferred == 0


# ---- 3. deadlines ----------------------------------------------------------------------------


def test_waiting_request_past_deadline_never_runs(model_dir: Path) -> None:
    clock = FakeClock(EPOCH)
    run = Run(make_scheduler(model_dir, clock=clock))
    fill_with_low(run)
    late = make_request(32, 5, HIGH + 1, time_limit=0)
    late_low = make_request(32, 5, LOW + 1, time_limit=5)
    run.s.add_request(late_low)
    clock.now += 10
    run.s.add_request(late)  # arrives already expired (its ticket's deadline had passed)
    run.step()
    for r in (late, late_low):
        assert r.request_id not in run.ever_scheduled
        assert run.finish[r.request_id] == FinishReason.ABORT
        assert run.tokens[r.request_id] == []
        assert r.request_id not in run.s.requests
    counters = counters_of(run.s)
    assert counters.deadline_drops_waiting == 2
    assert counters.preemptions == 0  # an expired request is not worth a preemption


def test_running_request_past_deadline_is_stopped_and_freed(model_dir: Path) -> None:
    clock = FakeClock(EPOCH)
    run = Run(make_scheduler(model_dir, clock=clock))
    req = make_request(64, 500, LOW, time_limit=5)
    run.s.add_request(req)
    list(run.steps(5))
    assert run.s.kv_cache_manager.usage > 0
    clock.now += 6
    out = run.step()
    assert req.request_id not in out.num_scheduled_tokens
    assert run.finish[req.request_id] == FinishReason.ABORT
    assert len(run.tokens[req.request_id]) == 5  # what its 5 steps produced before the deadline
    assert counters_of(run.s).deadline_drops_running == 1
    assert not run.s.has_unfinished_requests()
    assert run.s.kv_cache_manager.usage == 0.0


def test_an_engine_host_ahead_of_the_proxy_runs_a_request_its_whole_time(
    model_dir: Path,
) -> None:
    """The engine's host clock 10 s ahead of the proxy's: an 8 s request still gets its 8 s,
    counted from when the plugin received it (it was dropped at its first step: the absolute
    deadline had passed by this host's clock). Through the middleware's own rewrite."""
    proxy_now = 1.8e9
    ticket = Ticket(
        tier="low",
        priority=LOW,
        tenant="acme",
        deadline=proxy_now + 8,
        prefill_share=1.0,
        budget=500,
        request_id="req-1",
        body_sha256="-",
        issued_at=proxy_now,
        nonce="n",
    )
    body = rewrite_body({"prompt": "hi"}, ticket, path="/v1/completions", unticketed_priority=10)
    host = FakeClock(proxy_now + 10)
    run = Run(make_scheduler(model_dir, clock=host))
    req = make_request(64, 500, LOW, extra_args=body["vllm_xargs"])
    run.s.add_request(req)
    list(run.steps(3))
    assert req.request_id in run.ever_scheduled and req.request_id not in run.finish
    host.advance(7.9)
    run.step()
    assert req.request_id not in run.finish
    host.advance(0.2)  # its 8 s are up
    run.step()
    assert run.finish[req.request_id] == FinishReason.ABORT


def test_requests_without_deadline_are_untouched(model_dir: Path) -> None:
    clock = FakeClock(EPOCH)
    run = Run(make_scheduler(model_dir, clock=clock))
    req = make_request(16, 3, LOW)
    run.s.add_request(req)
    clock.now += 1e9
    run.until_done()
    assert run.finish[req.request_id] == FinishReason.LENGTH


# ---- flavours ------------------------------------------------------------------------------------


def test_async_flavour_is_chosen_and_preempts(model_dir: Path) -> None:
    class _Cfg:
        class scheduler_config:
            async_scheduling = True

    assert TierScheduler.__new__(TierScheduler, vllm_config=_Cfg()).__class__ is AsyncTierScheduler
    run = Run(make_scheduler(model_dir, AsyncTierScheduler))
    assert isinstance(run.s, AsyncScheduler)
    lows = fill_with_low(run, max_tokens=20)
    high = make_request(16, 4, HIGH)
    run.s.add_request(high)
    out = run.step()
    assert high.request_id in out.num_scheduled_tokens and out.preempted_req_ids
    run.until_done()
    assert all(run.finish[r.request_id] == FinishReason.LENGTH for r in [*lows, high])


def test_sync_flavour_on_cpu(model_dir: Path) -> None:
    s = make_scheduler(model_dir)
    assert type(s) is TierScheduler
    assert not isinstance(s, AsyncScheduler)
