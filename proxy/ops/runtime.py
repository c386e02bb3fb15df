"""Process-wide settings for a long-running proxy process."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# CPython's oldest-generation collections scan every live object. With a deep backlog they
# dominate the queue's cost: at 100,000 backlogged tenants (~300k tracked objects) they added
# about 5 µs to every pop at the default of one per 10 middle-generation collections
# (benchmarks/queue_bench.py). Young cycles are collected as often as before.
FULL_COLLECTION_EVERY = 1000


def tune_gc() -> None:
    """Freeze what start-up made (modules, config, app: never garbage, never scanned again)
    and make full collections rarer."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


# Set to "asyncio" to run on the standard loop even where uvloop is installed.
LOOP_ENV = "TIERPROXY_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (its sockets, timers and callbacks are C: fewer µs
    per relayed read and write), else None: the standard loop."""
    if os.environ.get(LOOP_ENV, "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def tune_logging() -> None:
    """Leave out what the log format never shows: the caller's file and line (a stack walk on
    every record, the access log's included), thread and process fields (the logging HOWTO's
    "Optimization" table)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
