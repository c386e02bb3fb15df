"""Worker threads that take their work in tier order: the prompts tokenized off the event loop
(proxy.request.prompt_blocks) wait for a free thread by their tier's priority, then by arrival,
so that a burst of worse tiers' long prompts does not queue the best tier's behind them (the
tiers order every shared resource, not only the backends' slots). What runs is never stopped.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

FIRST = -(2**63)  # ahead of every tier (a tokenizer's load)
_COMPACT_MIN = 256


class TieredThreads:
    """``threads`` daemon threads, started on the first submit; lower ``priority`` first."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self.name = name
        self._waiting: list[list[Any]] = []  # [priority, order, future, work or None]
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._started = False
        self._compact_at = _COMPACT_MIN  # entries, cancelled ones included, before a sweep

    def submit(self, priority: int, work: Callable[[], T]) -> Future[T]:
        """Queue ``work``; a future cancelled while it waits is dropped, never run."""
        future: Future[T] = Future()
        entry: list[Any] = [priority, next(self._order), future, work]
        # Cancelled while it waits: its work (and what it holds, a parsed prompt) goes now,
        # not when a thread reaches its entry (round seven F5).
        future.add_done_callback(lambda _: entry.__setitem__(3, None))
        with self._ready:
            if not self._started:
                self._started = True
                for n in range(self.threads):
                    worker = threading.Thread(target=self._serve, name=f"{self.name}-{n}")
                    worker.daemon = True  # pure computation: nothing to finish at exit
                    worker.start()
            if len(self._waiting) >= self._compact_at:
                # Entries cancelled while they waited stay until a thread reaches them, which a
                # flood of better priorities can put off for ever: swept here instead.
                self._waiting = [e for e in self._waiting if not e[2].done()]
                heapq.heapify(self._waiting)
                self._compact_at = max(_COMPACT_MIN, 2 * len(self._waiting))
            heapq.heappush(self._waiting, entry)
            self._ready.notify()
        return future

    @property
    def waiting(self) -> int:
        with self._ready:
            return len(self._waiting)

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                _, _, future, work = heapq.heappop(self._waiting)
            if not future.set_running_or_notify_cancel() or work is None:
                continue
            try:
                result = work()
            except BaseException as exc:  # the caller's to see, as an executor would give it
                future.set_exception(exc)
            else:
                future.set_result(result)
