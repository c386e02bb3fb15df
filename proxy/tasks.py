"""A background task with an owner: started once, cancelled and awaited on stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)
# How long a stop waits for a cancelled task to end (each await inside it has its own timeout).
STOP_WAIT_S = 10.0


class OwnedTask:
    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    def start(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._task is not None and not self._task.done():
            raise RuntimeError(f"{self.name} is already running")
        self._task = asyncio.create_task(run(), name=self.name)

    @property
    def done(self) -> bool:
        """Started, and ended by itself (not stopped): its owner may start it again."""
        return self._task is not None and self._task.done()

    async def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Cancel the task and wait for it, at most ``wait_s``: a task that swallows its
        cancel (a library's read that catches it) must not hold its owner's shutdown for
        ever; it is logged and left cancelled. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if not done:
            log.warning("task %s still runs %.0f s after its cancel: left", self.name, wait_s)
            return
        with contextlib.suppress(asyncio.CancelledError):
            await task
