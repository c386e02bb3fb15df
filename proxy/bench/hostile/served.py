"""The process that actually serves: `tierproxy serve` (``python -m proxy.cli serve``) as a
subprocess on its default loop (uvloop where installed) with aiohttp's C parser, in front of a
fake backend, as a user's deployment runs; its log in a file a test can read.

The fake backend is ``FakeVLLM`` (proxy.bench.fake_vllm) on an event loop of its own in a
thread of the test process: the served proxy reaches it whatever the test's loop is doing, it
starts in milliseconds, and a test can read its counters. The served tests' fixtures pick it
in one place (tests/adversarial/served/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

import yaml
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, SECRET, make_config
from proxy.bench.stack import ProxyProcess
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port, http_ok
from proxy.ops.runtime import LOOP_ENV
from proxy.ticket import DEFAULT_SECRET_ENV

ADMIN_KEY = "admin-key-for-the-served-tests"
HOST = "127.0.0.1"
LOG_TAIL_LINES = 40


class ThreadedUpstream:
    """An aiohttp app served on its own loop in a daemon thread; ``stop()`` joins it."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _call(self, make: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return future.result(timeout_s)

    def start(self) -> Self:
        self.thread.start()

        async def up() -> int:
            self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, HOST, 0, backlog=1024)
            await site.start()
            server = site._server
            assert server is not None
            sockets = getattr(server, "sockets", None) or []
            return int(sockets[0].getsockname()[1])

        self.port = self._call(up)
        return self

    def __enter__(self) -> Self:
        """Started if it was not yet (``with NullBackend() as upstream``)."""
        return self if self.thread.is_alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            self._call(runner.cleanup)
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


class NullBackend(ThreadedUpstream):
    """``FakeVLLM`` (fixed answers, counts what it serves; model ``null``) as the fake backend."""

    def __init__(self, null: FakeVLLM | None = None) -> None:
        self.null = null or FakeVLLM(model="null", usage=(4, 4))
        super().__init__(self.null.app())


def admin_sections() -> dict[str, Any]:
    """An admin listener on a free port, ``ADMIN_KEY`` its key."""
    return {
        "admin_listen": {"host": HOST, "port": free_port()},
        "admin_keys": [{"sha256": hash_key(ADMIN_KEY)}],
    }


def served_config(backend_url: str, *, admin: bool = True, **extra: Any) -> dict[str, Any]:
    """The demo tenants (``KEYS``) in front of ``backend_url``; an admin listener (with
    ``ADMIN_KEY``) unless ``admin`` is False; ``extra``: top-level sections (``server=...``)."""
    sections = {**admin_sections(), **extra} if admin else extra
    return make_config([{"url": backend_url, "max_inflight": 64}], **sections)


class ServedProxy:
    """`tierproxy serve -c <yaml>` started on a free port; up when /healthz answers."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, name: str = "proxy") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in (LOOP_ENV, "AIOHTTP_NO_EXTENSIONS")}
        env[DEFAULT_SECRET_ENV] = SECRET.decode()
        self.process = ProxyProcess(self.config_path, self.port, self.log_path, env=env)
        self.process.env = env  # as given: the default loop and parser, whatever ours are

    host = HOST

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def admin_port(self) -> int | None:
        admin = self.config.get("admin_listen")
        return int(admin["port"]) if admin else None

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port or self.port}"

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None, "the proxy is not started"
        return pid

    def start(self, ready_timeout_s: float = 60.0) -> Self:
        self.process.start(ready_timeout_s)
        if self.admin_port is not None:
            self.process.wait_until(
                lambda: http_ok(f"{self.admin_url}/healthz", timeout_s=2.0),
                ready_timeout_s,
                "the admin listener answering",
            )
        return self

    def stop(self) -> None:
        self.process.stop(grace_s=5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        if exc_type is not None:
            # A failing test's report (pytest's captured stderr) carries what the proxy said:
            # a CI run is read only through its report.
            tail = "\n".join(self.log_lines()[-LOG_TAIL_LINES:])
            print(f"--- {self.log_path.name}, its last lines ---\n{tail}", file=sys.stderr)

    def alive(self) -> bool:
        return self.process.alive()

    # -- what a test reads --------------------------------------------------------------------
    def rss_bytes(self, field: str = "VmRSS") -> int:
        """VmRSS (now) or VmHWM (the peak) from /proc."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise LookupError(f"{field} not in /proc/{self.pid}/status")

    def cpu_s(self) -> float:
        """CPU seconds the process has used (user + system, from /proc): work on its one event
        loop, counted apart from how busy the machine is."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def loaded(self, fragment: str) -> bool:
        """Whether a shared object whose path holds ``fragment`` is mapped (uvloop's loop,
        aiohttp's C parser)."""
        return fragment in Path(f"/proc/{self.pid}/maps").read_text()

    def on_default_loop(self) -> bool:
        return self.loaded("uvloop/loop.") and self.loaded("aiohttp/_http_parser.")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> list[str]:
        return self.log_text().splitlines()

    def mark(self) -> int:
        """The log's length now: ``lines_since(mark)`` reads only what came after."""
        return len(self.log_lines())

    def lines_since(self, mark: int) -> list[str]:
        return self.log_lines()[mark:]

    def count(self, pattern: str, since: int = 0) -> int:
        regex = re.compile(pattern)
        return sum(1 for line in self.lines_since(since) if regex.search(line))

    def tracebacks(self, since: int = 0) -> int:
        return self.count(r"^Traceback \(most recent call last\)", since)


class ServedFleet:
    """The served proxies one fixture starts (``proxy-0``, ``proxy-1``, ... in ``workdir``),
    each up and on its default loop when started; ``with`` stops them all on the way out."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[ServedProxy] = []

    def start(self, config: dict[str, Any]) -> ServedProxy:
        proxy = ServedProxy(config, self.workdir, name=f"proxy-{len(self.started)}")
        self.started.append(proxy)
        proxy.start()
        assert proxy.on_default_loop(), "the served proxy is not on uvloop with the C parser"
        return proxy

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        for proxy in self.started:
            proxy.__exit__(exc_type)  # stopped; on a failure, its log's last lines shown


def auth_header(tier: str) -> str:
    return f"Bearer {KEYS[tier]}"


# The ``start_served`` fixture: a served proxy in front of the module's backend.
StartServed = Callable[..., ServedProxy]
