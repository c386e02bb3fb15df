import asyncio

import pytest

from proxy.tasks import OwnedTask


async def test_stop_cancels_and_awaits_the_task_and_is_idempotent() -> None:
    started, cleaned_up = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.set()

    owned = OwnedTask("t")
    owned.start(run)
    await started.wait()
    await owned.stop()
    assert cleaned_up.is_set()  # the task's own cleanup ran before stop() returned
    await owned.stop()


async def test_a_running_task_cannot_be_started_twice() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    owned = OwnedTask("t")
    owned.start(forever)
    with pytest.raises(RuntimeError):
        owned.start(forever)
    await owned.stop()
