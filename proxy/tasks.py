"""A background task with an owner: started once, cancelled and awaited on stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


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

    async def stop(self) -> None:
        """Cancel and wait for the task; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
