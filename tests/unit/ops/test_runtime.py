"""The serving process's GC settings and event loop."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from proxy.ops import runtime
from proxy.ops.runtime import FULL_COLLECTION_EVERY, tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_tune_gc_freezes_start_up_and_makes_full_collections_rarer() -> None:
    young, middle, _ = gc.get_threshold()
    tune_gc()
    assert gc.get_threshold() == (young, middle, FULL_COLLECTION_EVERY)
    assert gc.get_freeze_count() > 0  # start-up's objects are out of every collection


def test_the_proxy_runs_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    monkeypatch.delenv(runtime.LOOP_ENV, raising=False)
    assert runtime.run(loop_type()) is uvloop.Loop
    monkeypatch.setenv(runtime.LOOP_ENV, "asyncio")
    assert runtime.loop_factory() is None
    assert not issubclass(runtime.run(loop_type()), uvloop.Loop)
