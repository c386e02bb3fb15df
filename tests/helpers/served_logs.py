"""What the served adversarial tests read of the served process: its usage log's records, and
a wait on a condition they poll."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson


def usage_records(log: Path) -> list[dict[str, Any]]:
    text = log.read_text() if log.exists() else ""
    return [orjson.loads(line) for line in text.splitlines()]


async def wait_for(test: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
