"""Live config reload: on SIGHUP and when the file changes (and then stays the same for a
moment), validate off the event loop and swap atomically.

A broken file changes nothing: the old config stays, the errors are logged with their lines
and counted in /metrics (``tierproxy_config_reloads_total{result="error"}``). So is a file that
cannot be read (gone, unreadable after an ownership change), and any other failure to load it:
the watcher outlives every file, or a later edit (a key revocation) would never apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from proxy.config.config_file import read_config_bytes
from proxy.config.loader import ConfigError, load_config, parse_config
from proxy.config.schema import Config, LoadedConfig
from proxy.signals import take_deferred_reloads
from proxy.tasks import OwnedTask
from proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger("tierproxy.reload")


Sleep = Callable[[float], Awaitable[None]]
# Works out, off the event loop, what a validated config changes; the function it returns
# applies that on the loop and returns what it replaced (dropped off the loop too).
Prepare = Callable[[LoadedConfig], Callable[[], object]]


# Read once, at start (proxy.server.app, proxy.server.listeners): a reload that changes one
# applies the rest of the file and logs, for each of these, that a restart is needed. Dotted:
# one field of a section that is otherwise live (the upstream session's connect timeout).
RESTART_FIELDS = (
    "listen",
    "admin_listen",
    "server",
    "ticket_secret_env",
    "shared_state",
    "usage_log",
    "tracing",
    "backend_health.connect_timeout_s",
    "backend_health.dead_connection_s",
)
# Applied by a reload (ProxyState.prepare): every other top-level section. A new section must be
# named in one of the two lists (tests/unit/ops/test_reload.py checks).
LIVE_SECTIONS = (
    "limits",
    "scheduling",
    "backend_health",
    "policies",
    "adaptive_room",
    "input",
    "relay",
    "tiers",
    "tenants",
    "backends",
    "admin_keys",
    "pricing",
    "adapters",  # read per request (access, price) and by the adapter router
    "kv_cache",  # the KV-event watcher and the prompt blocks read it as they go
)


def _value(config: Config, path: str) -> object:
    value: object = config
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def adapter_paths_changed(old: Config, new: Config) -> list[str]:
    """Adapters whose path a reload changed: vLLM keeps serving what it loaded under the name
    (a load of a name it holds is "already loaded")."""
    return [
        name
        for name, adapter in new.adapters.items()
        if name in old.adapters and old.adapters[name].path != adapter.path
    ]


def restart_needed(old: Config, new: Config) -> list[str]:
    """The fields whose change only a restart applies."""
    return [name for name in RESTART_FIELDS if _value(old, name) != _value(new, name)]


class ConfigWatcher:
    """Owns one polling task (and the SIGHUP handler, where the loop supports signals).

    A changed file is applied only when it reads the same ``debounce_s`` later (an editor or a
    `cp` that writes in pieces is never applied half-way); parsing and validation run in a
    worker thread so that requests keep moving meanwhile.
    """

    def __init__(
        self,
        path: str | Path,
        prepare: Prepare,
        metrics: ProxyMetrics,
        current: Callable[[], Config],
        *,
        interval_s: float = 1.0,
        debounce_s: float = 0.2,
        sleep: Sleep = asyncio.sleep,
        transform: Callable[[LoadedConfig], LoadedConfig] | None = None,
    ) -> None:
        self.path = Path(path)
        self.prepare = prepare
        self.metrics = metrics
        self.current = current
        self.interval_s = interval_s
        self.debounce_s = debounce_s
        self.sleep = sleep
        self.transform = transform  # a worker's share of the bounds (proxy.ops.worker_share)
        self._digest = self._read()[1]
        self._applied = self._digest  # the sha256 of the file in force (None: force a reload)
        self._read_error: str | None = None  # the unreadable file's error, reported once
        self._task = OwnedTask("tierproxy-config-watcher")
        self._lock = asyncio.Lock()
        self._sighup_installed = False

    def _read(self) -> tuple[bytes | None, bytes | None, str | None]:
        """(the file's bytes, their sha256, None), or (None, None, why) where it cannot be read."""
        try:
            data = read_config_bytes(self.path)
        except OSError as exc:
            return None, None, f"cannot read {self.path}: {exc.strerror or exc}"
        return data, hashlib.sha256(data).digest(), None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup_installed = True
        if self._sighup_installed and take_deferred_reloads():
            self._on_sighup()  # asked for while the proxy started
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
        self._applied = None  # reloaded even if unchanged: the operator asked
        self._read_error = None  # an unreadable file is reported again

    async def _poll(self) -> None:
        while True:
            await self.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # a bug, not the file: say so, and keep watching
                self._failed()
                log.exception("config watcher: reloading %s failed; still watching", self.path)

    def _failed(self) -> None:
        self.metrics.config_reloads.labels("error").inc()

    async def check(self) -> bool:
        """One poll: when the file changed and then stayed the same for ``debounce_s``, reload
        it; True when a new config came into force. A file that cannot be read for as long is
        a failed reload (logged and counted once, until it changes or SIGHUP)."""
        _, digest, error = await asyncio.to_thread(self._read)
        if error is not None:
            return await self._unreadable(error)
        if self._read_error is not None:
            log.info("config %s can be read again", self.path)
            self._read_error = None
        if digest == self._digest:
            return False
        await self.sleep(self.debounce_s)
        data, again, _ = await asyncio.to_thread(self._read)
        if data is None or again != digest:
            log.info("config %s is still changing; waiting for it to settle", self.path)
            return False
        self._digest = digest
        if digest == self._applied:  # an edit undone: the file in force again
            log.info("config %s is back to the config in force: nothing to reload", self.path)
            return False
        if not await self.reload(data):
            return False
        self._applied = digest
        return True

    async def _unreadable(self, error: str) -> bool:
        if error == self._read_error:
            return False
        await self.sleep(self.debounce_s)  # an editor's delete-and-write is not a failure
        if (await asyncio.to_thread(self._read))[2] != error:
            return False
        self._read_error = error
        self._failed()
        log.error("config reload failed, keeping the old config: %s", error)
        return False

    async def reload(self, data: bytes | None = None) -> bool:
        """Load, validate and apply the file (or ``data``, the bytes read from it) now, parsing
        off the event loop; True when the new config is in force."""
        async with self._lock:
            try:
                loaded, commit = await asyncio.to_thread(self._load_and_prepare, data)
            except ConfigError as exc:
                self._failed()
                log.error(
                    "config reload failed, keeping the old config: %d problem(s)", len(exc.problems)
                )
                for problem in exc.problems:
                    log.error("  %s: %s", exc.source, problem)
                return False
            except Exception as exc:  # the loader's or prepare's bug: still a failed reload
                self._failed()
                log.error(
                    "config reload failed, keeping the old config: %s: %s",
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                return False
            for name in restart_needed(self.current(), loaded.config):
                log.warning("config reload: %s changed; it takes effect only after a restart", name)
            for name in adapter_paths_changed(self.current(), loaded.config):
                log.warning("config reload: adapter %s has a new path; an engine that holds it"
                            " keeps the old weights until it is unloaded there (a new name"
                            " applies new weights at once)", name)  # fmt: skip
            replaced = [commit()]
            del commit  # it holds the old config too
            self.metrics.config_reloads.labels("ok").inc()
            log.info("config reloaded from %s", self.path)
            # Freeing a 10,000-tenant config takes milliseconds: not on the loop.
            await asyncio.to_thread(replaced.clear)
            return True

    def _load_and_prepare(self, data: bytes | None) -> tuple[LoadedConfig, Callable[[], object]]:
        loaded = self._load(data)
        if self.transform is not None:
            loaded = self.transform(loaded)
        return loaded, self.prepare(loaded)

    def _load(self, data: bytes | None) -> LoadedConfig:
        if data is None:
            return load_config(self.path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(str(self.path), [f"not UTF-8: {exc}"]) from exc
        return parse_config(text, source=str(self.path))
