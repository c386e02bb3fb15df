"""What the served tests read of the served process (its usage log's records), a wait on a
condition they poll, and a reload by SIGHUP that waits for the process to log it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

from proxy.bench.hostile.served import ServedProxy


def usage_records(log: Path) -> list[dict[str, Any]]:
    text = log.read_text() if log.exists() else ""
    return [orjson.loads(line) for line in text.splitlines()]


async def wait_for(test: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def sighup_reload(
    proxy: ServedProxy, config: dict[str, Any], expect: str = "config reloaded"
) -> None:
    """Write ``config`` in place of the file, SIGHUP, and wait for the log line ``expect``."""
    mark = proxy.mark()
    staged = proxy.config_path.with_suffix(".new")
    staged.write_text(yaml.safe_dump(config))
    staged.replace(proxy.config_path)
    os.kill(proxy.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while not any(expect in line for line in proxy.lines_since(mark)):
        assert time.monotonic() < deadline, "\n".join(proxy.lines_since(mark))[-2000:]
        await asyncio.sleep(0.1)
