"""A real Prometheus (Debian's ``prometheus`` package: 2.42 with promtool; `make test` installs
it) for the tests that check the dashboard and the rules: its own data directory, a free
loopback port, one Go thread on the core the proxies use (the others spin with the engines),
stopped with its process group at the end (and if the test process dies: proxy.ops.process).
Queried over its HTTP API as Grafana queries it."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from proxy.ops.process import ManagedProcess, free_port

# Where the test runs without it (not root, no apt): skip with this.
MISSING = "prometheus is not installed (make test installs Debian's package as root)"


_TIMEOUT = aiohttp.ClientTimeout(total=10)


def available() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


class PrometheusServer(ManagedProcess):
    """Prometheus scraping ``scrape_configs`` every ``interval_s``."""

    def __init__(
        self, workdir: Path, scrape_configs: list[dict[str, Any]], *, interval_s: float = 1.0
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.interval_s = interval_s
        config = {
            "global": {"scrape_interval": f"{interval_s:g}s", "scrape_timeout": "1s"},
            "scrape_configs": scrape_configs,
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        command = [
            "prometheus",
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        env = {**os.environ, "GOMAXPROCS": "1"}
        last_core = max(os.sched_getaffinity(0))
        super().__init__(
            command,
            env=env,
            log_path=workdir / "prometheus.log",
            cpus=frozenset({last_core}),
            name="prometheus",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self, timeout_s: float = 20.0) -> None:
        """Started and answering /-/ready (the loop stays free: proxies it scrapes may run on
        it)."""
        self.start()
        await self._until(lambda: self._get("/-/ready"), timeout_s, "/-/ready")

    async def _get(self, path: str) -> bool:
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as s:
            try:
                async with s.get(self.url + path) as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

    async def _until(
        self, ready: Callable[[], Awaitable[bool]], timeout_s: float, what: str
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not await ready():
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"prometheus: no {what} in {timeout_s:g}s; {self.log_hint()}")
            await asyncio.sleep(0.1)

    async def api(self, path: str, **params: str) -> Any:
        """``data`` of an API answer; raises with Prometheus' own error when it is not a
        success (a query that does not parse says why)."""
        async with (
            aiohttp.ClientSession(timeout=_TIMEOUT) as s,
            s.get(f"{self.url}/api/v1/{path}", params=params) as resp,
        ):
            body = orjson.loads(await resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {resp.status} {body}")
        return body["data"]

    async def targets(self) -> dict[str, str]:
        """Each active target's scrape URL and health (up, down, unknown) with its error."""
        active = (await self.api("targets", state="active"))["activeTargets"]
        return {t["scrapeUrl"]: f"{t['health']} {t['lastError']}".strip() for t in active}

    async def targets_up(self, count: int, timeout_s: float = 15.0) -> None:
        async def all_up() -> bool:
            health = await self.targets()
            return len(health) >= count and all(h == "up" for h in health.values())

        try:
            await self._until(all_up, timeout_s, f"{count} targets up")
        except AssertionError as exc:
            raise AssertionError(f"{await self.targets()}: {exc}") from None

    async def scraped_since(self, since: float, scrapes: int = 1, timeout_s: float = 60.0) -> float:
        """Until every active target has had ``scrapes`` good scrapes begun at ``since`` (Unix
        seconds) or later: Prometheus's own scrapes counted, not waited for in seconds (a busy
        host's come late, or time out). The latest of them (its samples' time)."""
        seen: dict[str, set[float]] = {}

        async def counted() -> bool:
            for target in (await self.api("targets", state="active"))["activeTargets"]:
                at = datetime.fromisoformat(target["lastScrape"]).timestamp()
                got = seen.setdefault(target["scrapeUrl"], set())
                if target["health"] == "up" and at >= since:
                    got.add(at)
            return bool(seen) and all(len(got) >= scrapes for got in seen.values())

        await self._until(counted, timeout_s, f"{scrapes} good scrape(s) of every target")
        return max(max(got) for got in seen.values())

    async def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Any]:
        data = await self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}s"
        )
        assert data["resultType"] == "matrix", data
        return list(data["result"])
