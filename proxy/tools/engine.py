"""Start, watch and stop a stock vLLM OpenAI server (CPU build here, GPU build elsewhere).

Used by `tierproxy engine`, `tierproxy up` and the test suite, so that all three start vLLM
the same way: same flags, same readiness check, same teardown of the whole process tree.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from proxy.config.kv_cache import kv_cache_on
from proxy.config.schema import Config
from proxy.ops.process import ManagedProcess, confine_tree, free_port, http_ok, tail
from proxy.ticket import PLUGIN_CLASS_FLAGS, PRIORITY_FLAGS

# Re-exported: tests and tools import these from here.
__all__ = [
    "DEFAULT_MODEL_DIR",
    "POOLING_ARGS",
    "TINY_SERVED_NAME",
    "EngineProcess",
    "EngineSpec",
    "confinement_note",
    "cpu_confinement",
    "engine_cores",
    "ensure_model",
    "free_port",
    "http_ok",
    "kv_event_args",
    "kv_events_wanted",
    "plugin_available",
    "spread_cores",
    "tail",
]

DEFAULT_MODEL_DIR = Path(".tierproxy/tiny-model")
TINY_SERVED_NAME = "tiny"
# The tiny Llama as a pooling model (last-token pooling, normalised): vLLM's CPU build serves
# /v1/embeddings, /pooling, /score and /rerank from it (score and rerank as cosine similarity).
POOLING_ARGS: tuple[str, ...] = ("--runner", "pooling", "--convert", "embed")


def plugin_available() -> bool:
    """The plugin's modules can be loaded (they can once vllm is installed beside us)."""
    try:
        import proxy.vllm_plugin.middleware as _middleware
        import proxy.vllm_plugin.scheduler as _scheduler
    except ImportError:
        return False
    return bool(_middleware and _scheduler)


@dataclass
class EngineSpec:
    port: int
    model: str
    served_name: str | None = None
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    plugin: bool = True
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    # CPU build: cores for the engine's OMP threads, e.g. "1" or "2-3". vLLM's "auto" binds every
    # engine on a machine to the same first core, so co-located engines must be told apart.
    cpu_bind: str | None = None
    # Cores the engine's whole process tree may run on (None: any); see engine_cores().
    cpus: frozenset[int] | None = None
    # ZMQ port of its KV-event publisher, for the proxy's prefix-cache index (kv_cache); None:
    # no KV events. ``block_size`` goes with it (the proxy hashes blocks of that size).
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    block_size: int = 32

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--disable-uvicorn-access-log",
        ]
        if self.served_name:
            cmd += ["--served-model-name", self.served_name]
        if _on_cpu():
            cmd.append("--enforce-eager")  # starts in ~25 s instead of ~60 s
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        # Priority scheduling also without the plugin: the proxy sets vLLM's own priority.
        cmd += PRIORITY_FLAGS
        if self.plugin and plugin_available():
            cmd += PLUGIN_CLASS_FLAGS
        if self.kv_events_port is not None:
            cmd += kv_event_args(self.kv_events_port, self.block_size, self.kv_replay_port)
        cmd += list(self.extra_args)
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        bind = self.cpu_bind
        if bind is None and self.cpus is not None:  # "auto" may reserve the only allowed core
            bind = ",".join(str(core) for core in sorted(self.cpus))
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        env.update(self.env)
        return env


def kv_event_args(port: int, block_size: int, replay_port: int | None = None) -> tuple[str, ...]:
    """vLLM's flags for the proxy's prefix-cache index (``kv_cache``): prefix caching with the
    block size the proxy hashes, each answer's cached prompt tokens in its usage, and its KV
    events on a ZMQ publisher at ``port`` (a wildcard host: vLLM binds only such endpoints; the
    proxy finds it through ``GET /kv_event_sources``), with its replay socket at
    ``replay_port`` (batches a gap lost are asked again there)."""
    events: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
    }
    if replay_port is not None:
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
    return (
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(events, separators=(",", ":")),
    )


def kv_events_wanted(config: Config) -> int | None:
    """The block size the config's prefix-cache index hashes with, when it runs (the engines
    must then publish KV events); None: it does not."""
    kv = config.kv_cache
    return kv.block_size if kv_cache_on(kv, config.policies.backends) else None


def _on_cpu() -> bool:
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


class EngineProcess(ManagedProcess):
    """One vLLM server in its own process group, so that stopping it stops its children too.

    Confined engines start on any core and move onto their cores once ready (``confine``): a
    start is ~25 s of imports in three processes, one after another, that would otherwise
    queue behind the engines already serving on those cores; the engine's compute threads
    are bound to its cores from the start (``VLLM_CPU_OMP_THREADS_BIND``). Idle, a starting
    engine does not spin."""

    def __init__(self, spec: EngineSpec, log_path: Path | None = None) -> None:
        super().__init__(
            spec.command(), env=spec.environment(), log_path=log_path, name=f"vLLM on {spec.url}"
        )
        self.spec = spec
        self.confined = spec.cpus is None  # nothing to move

    def start(self) -> Self:
        # A restarted engine is moved onto its cores again: its new processes start anywhere
        # (an engine restarted in a test ran unconfined beside the proxy, on its core).
        self.confined = self.spec.cpus is None
        return super().start()

    def ready(self) -> bool:
        """Whether /v1/models answers now; once it does, the engine is moved onto its cores."""
        if not http_ok(f"{self.spec.url}/v1/models", timeout_s=2.0):
            return False
        self.confine()
        return True

    def confine(self) -> None:
        if not self.confined and self.pid is not None and self.spec.cpus is not None:
            confine_tree(self.pid, self.spec.cpus)
            self.confined = True

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Block until /v1/models answers; raises if the process dies or time runs out."""
        self.wait_until(self.ready, timeout_s, "ready", poll_s=0.5)


def ensure_model(model: str | None) -> tuple[str, str | None]:
    """(model path or name, served name): with no model given, make and use the tiny one."""
    if model:
        return model, None
    from proxy.tools.tiny_model import make_tiny_model

    return str(make_tiny_model(DEFAULT_MODEL_DIR).resolve()), TINY_SERVED_NAME


def engine_cores() -> frozenset[int] | None:
    """Where local CPU engines run: every core but the last, which stays for the proxy and its
    clients (None on a single core: nothing to keep apart).

    vLLM's engine-core process spins on sched_yield while its worker computes. On a small VM
    that spinner starved the timers of other processes on its core for seconds (a 0.5 s sleep
    in the proxy's process woke 12 s late, so a 0.5 s execution timeout fired after vLLM had
    finished the request); confined with its engine, it starves nothing else."""
    allowed = sorted(os.sched_getaffinity(0))
    return frozenset(allowed[:-1]) if len(allowed) > 1 else None


def cpu_confinement() -> frozenset[int] | None:
    """Where a CPU engine started by hand (`tierproxy engine`) runs: engine_cores(), as `up`
    and the tests place theirs. A GPU engine's host threads do not spin: left anywhere."""
    return engine_cores() if _on_cpu() else None


def confinement_note(cpus: frozenset[int] | None) -> str:
    """One line for the operator: where the engine runs and what stays free."""
    if cpus is None:
        return "engine not confined to CPU cores (GPU build, or a single core)"
    free = sorted(os.sched_getaffinity(0) - cpus)
    return (
        f"CPU engine confined to cores {','.join(map(str, sorted(cpus)))}; "
        f"core(s) {','.join(map(str, free))} stay free for the proxy and its clients"
    )


def spread_cores(index: int) -> str | None:
    """OMP core for the index-th of several co-located CPU engines, among engine_cores()
    (None: leave vLLM's default)."""
    cores = engine_cores()
    return str(sorted(cores)[index % len(cores)]) if cores else None


def local_engine(
    *,
    model: str | None = None,
    served_name: str | None = None,
    port: int | None = None,
    index: int | None = None,
    **settings: Any,
) -> EngineSpec:
    """A local vLLM engine as every launcher here wants it: ``model`` (None: the tiny one,
    made on first use) on a free port, confined to the engine cores (see ``engine_cores``);
    ``index`` spreads co-located engines over those cores. Other ``EngineSpec`` fields as
    keywords (``max_num_seqs``, ``plugin``, ``extra_args``, ``env``, ``cpus`` to override)."""
    path, served = ensure_model(model)
    settings.setdefault("cpus", engine_cores())
    if index is not None:
        settings.setdefault("cpu_bind", spread_cores(index))
    return EngineSpec(
        port=port if port is not None else free_port(),
        model=path,
        served_name=served_name or served,
        **settings,
    )
