"""The vLLM engine settings the suite runs, by name, and the one place that builds their spec.

A test module says which engines it uses with ``pytest.mark.engines(CORE, ...)``; the farm
(tests/helpers/enginefarm.py) starts each setting once, and the collection is ordered
(tests/helpers/engineplan.py) so that the tests sharing an engine run together and engines start while
tests that need none run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from proxy.bench.inproc import SECRET
from proxy.bench.plugin.requests import ENGINE_ARGS as PLUGIN_BENCH_ARGS
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import (
    POOLING_ARGS,
    TINY_SERVED_NAME,
    EngineSpec,
    free_port,
    local_engine,
)
from proxy.tools.tiny_adapters import LORA_CPU_ARGS
from proxy.vllm_plugin.settings import ENV_REQUIRE_TICKET

PLUGIN_SECRET = "plugin-test-secret-of-at-least-32-bytes"


@dataclass(frozen=True)
class EngineSetting:
    """How one test engine is started; equal settings are one engine."""

    name: str
    max_num_seqs: int = 4
    plugin: bool = False
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kv_events: bool = False  # KV events on a free ZMQ port, prefix caching, blocks of 32

    @staticmethod
    def environ(values: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(values.items()))

    def spec(self, model: Path, index: int) -> EngineSpec:
        """The index-th engine the session starts, on a free port, confined to the engine
        cores (off the last one, where this process runs the proxy: see DESIGN.md)."""
        return local_engine(
            model=str(model),
            served_name=TINY_SERVED_NAME,
            index=index,
            max_num_seqs=self.max_num_seqs,
            plugin=self.plugin,
            extra_args=self.extra_args,
            env=dict(self.env),
            kv_events_port=free_port() if self.kv_events else None,
            kv_replay_port=free_port() if self.kv_events else None,
        )


# vLLM exporting its request spans (`--otlp-traces-endpoint`) over OTLP/gRPC to the tests'
# receiver (tests/helpers/otlp.py) on a unix socket of this run: a path known before the engine
# starts, unlike a free port. vLLM exports only the spans of requests that carry a sampled
# traceparent (only the tracing tests send one); its batch processor sends every 100 ms rather
# than every 5 s.
OTLP_SOCKET = Path(tempfile.gettempdir()) / f"tierproxy-otlp-{os.getpid()}.sock"
# The generative engine most tests share (--max-num-seqs 4): a 16k context (the proxy-core tests
# hold requests of 16,000 tokens) and its spans exported (the tracing tests). One setting for
# what once took three engine starts (~20 s of a core each).
CORE = EngineSetting(
    "core",
    extra_args=("--max-model-len", "16384", "--otlp-traces-endpoint", f"unix://{OTLP_SOCKET}"),
    env=EngineSetting.environ(
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    ),
)
LONG_CONTEXT = CORE
TRACED = CORE
# A second generative engine like CORE (same context: the same batches), for the tests that meter
# over two backends.
PAIR_B = EngineSetting("pair-b", extra_args=("--max-model-len", "16384"))
# The tiny model served for pooling, no plugin: compared directly with the proxy.
EMBED = EngineSetting("compat-embed", extra_args=POOLING_ARGS)
# The pooling engine with the plugin requiring a ticket on every route.
POOLING_TICKETED = EngineSetting(
    "pooling",
    plugin=True,
    extra_args=POOLING_ARGS,
    env=EngineSetting.environ({DEFAULT_SECRET_ENV: SECRET.decode(), ENV_REQUIRE_TICKET: "1"}),
)
# Prefix caching on in blocks of 32 (the CPU attention needs a multiple of 32) with the flags
# `tierproxy up` passes for kv_cache (proxy.tools.engine.kv_event_args: cached tokens in usage, KV
# events over ZMQ on a free port), the plugin with the suite's secret: the tenant isolation
# tests (tests/integration/test_isolation_vllm.py) and the KV-cache index's
# (tests/integration/test_kvindex_vllm.py) share it.
PREFIX_CACHE = EngineSetting(
    "prefix-cache",
    plugin=True,
    kv_events=True,
    env=EngineSetting.environ({DEFAULT_SECRET_ENV: SECRET.decode()}),
)
KV_EVENTS = PREFIX_CACHE
# Fairness by the work caused (test_work_fairness_vllm.py) and the cost of cached prompt tokens
# (test_cost_vllm.py) need each answer's cached prompt tokens: PREFIX_CACHE reports them
# (--enable-prompt-tokens-details), one engine start fewer.
PROMPT_DETAILS = PREFIX_CACHE
# Stock vLLM and the plugin, with the same flags, for the plugin's A/B tests.
_PLUGIN_ENV = EngineSetting.environ(
    {"TIERPROXY_TICKET_SECRET": PLUGIN_SECRET, "TIERPROXY_PLUGIN_STATS_INTERVAL_S": "1"}
)
PLUGIN_STOCK = EngineSetting("plugin-stock", extra_args=PLUGIN_BENCH_ARGS, env=_PLUGIN_ENV)
PLUGIN_ON = EngineSetting("plugin-on", plugin=True, extra_args=PLUGIN_BENCH_ARGS, env=_PLUGIN_ENV)
# LoRA on (rank 8, two adapters at once) with runtime loading, KV events and the plugin: the
# adapter tests (tests/integration/test_adapters_vllm.py) load the tiny adapters through the
# proxy (proxy.tools.tiny_adapters); the engine starts with none.
LORA = EngineSetting(
    "lora",
    plugin=True,
    kv_events=True,
    extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", *LORA_CPU_ARGS),
    env=EngineSetting.environ(
        {DEFAULT_SECRET_ENV: SECRET.decode(), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    ),
)
