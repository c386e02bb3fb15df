"""The tokenizer's worker threads (proxy.request.tiered_threads): waiting work runs by priority
(lower first), then by arrival; work cancelled while it waits never runs; a failure reaches
the caller."""

from __future__ import annotations

import gc
import threading
import weakref
from concurrent.futures import CancelledError, Future
from functools import partial

import pytest

from proxy.request.tiered_threads import FIRST, TieredThreads


def _busy(threads: TieredThreads, gate: threading.Event) -> Future[bool]:
    """Work that holds the one thread until ``gate`` opens; running when this returns. (The
    bound only ends a failed test's thread: a busy machine took 10 s between two lines.)"""
    running = threading.Event()

    def hold() -> bool:
        running.set()
        return gate.wait(300)

    busy = threads.submit(5, hold)
    assert running.wait(10)
    return busy


def test_waiting_work_runs_best_priority_first_then_in_arrival_order() -> None:
    threads, gate, ran = TieredThreads(1, "test"), threading.Event(), list[str]()
    busy = _busy(threads, gate)
    queued = [
        threads.submit(priority, partial(ran.append, name))
        for priority, name in [(2, "low"), (1, "normal"), (0, "high-a"), (0, "high-b")]
    ]
    queued.append(threads.submit(FIRST, partial(ran.append, "load")))
    assert threads.waiting == 5  # the one thread is busy: all wait
    gate.set()
    assert busy.result(10) is True
    for future in queued:
        future.result(10)
    assert ran == ["load", "high-a", "high-b", "normal", "low"]


def test_work_cancelled_while_waiting_never_runs_and_failures_reach_the_caller() -> None:
    threads, gate, ran = TieredThreads(1, "test"), threading.Event(), list[str]()
    _busy(threads, gate)
    left = threads.submit(0, lambda: ran.append("left"))
    assert left.cancel()  # its client left while it waited
    failing = threads.submit(0, lambda: 1 // 0)
    gate.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    with pytest.raises(CancelledError):
        left.result(0)
    assert ran == [] and threads.waiting == 0


def test_work_cancelled_while_waiting_is_let_go_at_once() -> None:
    """Round seven F5: a cancelled entry kept its work (a parsed prompt, megabytes) until a
    thread reached it, which under a flood of better tiers could be never."""

    class Prompt:
        def __call__(self) -> None:
            return None

    threads, gate = TieredThreads(1, "test"), threading.Event()
    _busy(threads, gate)
    prompt = Prompt()
    held = weakref.ref(prompt)
    waiting = threads.submit(0, prompt)
    del prompt
    assert held() is not None  # queued: kept for its thread
    assert waiting.cancel()
    gc.collect()
    assert held() is None and threads.waiting == 1  # the entry stays, its work does not
    gate.set()


def test_cancelled_entries_are_swept_while_better_work_keeps_the_threads() -> None:
    """Under a flood of better priorities a thread never reaches a cancelled entry: the
    queue is swept on submit, so it holds about twice the live entries at most."""
    threads, gate = TieredThreads(1, "test"), threading.Event()
    _busy(threads, gate)
    for _ in range(2_000):
        threads.submit(5, lambda: None).cancel()
    live = threads.submit(5, lambda: "ran")
    assert threads.waiting <= 2 * 256
    gate.set()
    assert live.result(10) == "ran"
