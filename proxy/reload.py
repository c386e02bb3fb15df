"""Live config reload: on SIGHUP and when the file changes, validate and swap atomically.

A broken file changes nothing: the old config stays, the errors are logged with their lines
and counted in /metrics (``tierproxy_config_reloads_total{result="error"}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from proxy.config import ConfigError, LoadedConfig, load_config
from proxy.metrics import ProxyMetrics
from proxy.tasks import OwnedTask

log = logging.getLogger("tierproxy.reload")


class ConfigWatcher:
    """Owns one polling task (and the SIGHUP handler, where the loop supports signals)."""

    def __init__(
        self,
        path: str | Path,
        apply: Callable[[LoadedConfig], None],
        metrics: ProxyMetrics,
        interval_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.metrics = metrics
        self.interval_s = interval_s
        self._digest = self._read_digest()
        self._task = OwnedTask("tierproxy-config-watcher")
        self._lock = asyncio.Lock()
        self._sighup_installed = False

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup_installed = True
        self._task.start(self._poll)

    async def stop(self) -> None:
        if self._sighup_installed:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await self._task.stop()

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading %s", self.path)
        # Runs inside the polling task's next turn so that reloads never overlap.
        self._digest = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            digest = self._read_digest()
            if digest is not None and digest != self._digest:
                self._digest = digest
                await self.reload()

    async def reload(self) -> bool:
        """Load, validate and apply the file now; True when the new config is in force."""
        async with self._lock:
            try:
                loaded = load_config(self.path)
            except ConfigError as exc:
                self.metrics.config_reloads.labels("error").inc()
                log.error(
                    "config reload failed, keeping the old config: %d problem(s)", len(exc.problems)
                )
                for problem in exc.problems:
                    log.error("  %s: %s", exc.source, problem)
                return False
            self.apply(loaded)
            self.metrics.config_reloads.labels("ok").inc()
            log.info("config reloaded from %s", self.path)
            return True
