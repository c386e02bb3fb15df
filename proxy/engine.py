"""Start, watch and stop a stock vLLM OpenAI server (CPU build here, GPU build elsewhere).

Used by `tierproxy engine`, `tierproxy up` and the test suite, so that all three start vLLM
the same way: same flags, same readiness check, same teardown of the whole process tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

DEFAULT_MODEL_DIR = Path(".tierproxy/tiny-model")
TINY_SERVED_NAME = "tiny"

# The plugin's extension points in stock vLLM (see proxy/vllm_plugin). The scheduling policy
# flag is what makes vLLM honour the priority the plugin (or the proxy) sets.
# One scheduler class for CPU and GPU: it follows vLLM's async-scheduling choice by itself.
PLUGIN_ARGS: tuple[str, ...] = (
    "--middleware",
    "proxy.vllm_plugin.middleware.TicketMiddleware",
    "--scheduler-cls",
    "proxy.vllm_plugin.scheduler.TierScheduler",
)
PRIORITY_ARGS: tuple[str, ...] = ("--scheduling-policy", "priority")


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
        cmd += PRIORITY_ARGS
        if self.plugin and plugin_available():
            cmd += PLUGIN_ARGS
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


def _on_cpu() -> bool:
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


class EngineProcess:
    """One vLLM server in its own process group, so that stopping it stops its children too."""

    def __init__(self, spec: EngineSpec, log_path: Path | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineProcess:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        cpus = self.spec.cpus

        def in_child() -> None:
            _die_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            self.spec.command(),
            env=self.spec.environment(),
            preexec_fn=in_child,
            stdout=self._log if self._log is not None else None,
            stderr=subprocess.STDOUT if self._log is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Block until /v1/models answers; raises if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM on {self.spec.url} exited early; {self._log_hint()}")
            if http_ok(f"{self.spec.url}/v1/models", timeout_s=2.0):
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM on {self.spec.url} not ready in {timeout_s:.0f}s; {self._log_hint()}"
        )

    def _log_hint(self) -> str:
        if self.log_path is None:
            return "see its output above"
        return f"log: {self.log_path}\n{tail(self.log_path)}"

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Children left behind in the group (engine core, workers) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


# Looked up here, in the parent: the child, between fork and exec, must not import or load.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started us dies, however it dies, so a
    crashed test run or launcher never leaves a 3 GB engine behind (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def http_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def ensure_model(model: str | None) -> tuple[str, str | None]:
    """(model path or name, served name): with no model given, make and use the tiny one."""
    if model:
        return model, None
    from proxy.tiny_model import make_tiny_model

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


def spread_cores(index: int) -> str | None:
    """OMP core for the index-th of several co-located CPU engines, among engine_cores()
    (None: leave vLLM's default)."""
    cores = engine_cores()
    return str(sorted(cores)[index % len(cores)]) if cores else None


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
