"""`tierproxy serve --workers N`: N proxy processes on one port (SO_REUSEPORT: the kernel
spreads new connections over them), and this owner process that starts them, restarts one that
dies, forwards SIGHUP (reload) and stops them all on SIGTERM/SIGINT. With N > 1 the workers
must share tenant limits, fairness and backend room: ``shared_state`` is required. The
per-process bounds are divided among the workers (``proxy.ops.worker_share``): the port-wide
totals are the config's, logged at start."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from types import FrameType

from proxy.config.loader import ConfigError, load_config
from proxy.ops.process import ManagedProcess
from proxy.ops.worker_share import WorkerShare, shares_summary

log = logging.getLogger("tierproxy.workers")

# A worker that dies sooner than this after its start is restarted only this long after it.
RESTART_BACKOFF_S = 1.0
CHECK_EVERY_S = 0.2


def check_workers(config_path: str, workers: int, port: int | None) -> None:
    """Raises ConfigError when the config cannot run ``workers`` processes; else logs how the
    per-process bounds are shared among them."""
    loaded = load_config(config_path)
    problems = []
    if workers > 1 and loaded.config.shared_state is None:
        problems.append(
            f"--workers {workers} needs a shared_state: section (a Redis the workers share"
            " limits, fairness and backend room through); without it each worker would admit"
            " a tenant's whole limit"
        )
    if (port if port is not None else loaded.config.listen.port) == 0:
        problems.append("--workers needs a fixed port (listen.port or --port), not 0")
    if problems:
        raise ConfigError(loaded.source, problems)
    log.info("%d workers share the per-process bounds (port-wide totals as configured):", workers)
    for line in shares_summary(loaded.config, workers):
        log.info("  %s", line)


class WorkerOwner:
    def __init__(self, config_path: str, workers: int, host: str | None, port: int | None) -> None:
        self.command = [sys.executable, "-m", "proxy.cli", "serve", "-c", config_path]
        self.command += ["--reuse-port"]
        if host is not None:
            self.command += ["--host", host]
        if port is not None:
            self.command += ["--port", str(port)]
        self.workers: list[ManagedProcess] = []
        self.started_at: list[float] = []
        self.count = workers
        self._stop = threading.Event()

    def _spawn(self, slot: int) -> ManagedProcess:
        share = ["--worker-share", str(WorkerShare(slot, self.count))]
        proc = ManagedProcess(self.command + share, name=f"worker {slot}").start()
        log.info("worker %d started (pid %s)", slot, proc.pid)
        return proc

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        for slot in range(self.count):
            self.workers.append(self._spawn(slot))
            self.started_at.append(time.monotonic())
        try:
            while not self._stop.wait(CHECK_EVERY_S):
                self._replace_dead()
        finally:
            for proc in self.workers:
                proc.stop(grace_s=10.0)
        log.info("all workers stopped")
        return 0

    def _replace_dead(self) -> None:
        now = time.monotonic()
        for slot, proc in enumerate(self.workers):
            if proc.alive():
                continue
            if now - self.started_at[slot] < RESTART_BACKOFF_S:
                continue  # crashing at start: do not spin
            code = proc.proc.returncode if proc.proc is not None else None
            log.warning("worker %d (pid %s) exited with %s: starting another", slot, proc.pid, code)
            proc.stop()
            self.workers[slot] = self._spawn(slot)
            self.started_at[slot] = now

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        for proc in self.workers:
            proc.signal(signal.SIGHUP)


def serve_workers(config_path: str, workers: int, host: str | None, port: int | None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    check_workers(config_path, workers, port)
    return WorkerOwner(config_path, workers, host, port).run()
