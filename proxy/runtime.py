"""Process-wide settings for a long-running proxy process."""

from __future__ import annotations

import gc

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
