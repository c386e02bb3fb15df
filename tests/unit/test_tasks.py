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


async def test_a_task_that_swallows_its_cancel_does_not_hold_the_stop_for_ever() -> None:
    """A full run's engine half hung for over 30 min in a proxy's shutdown with its event loop
    idle (2026-12-03): a stop that awaits a cancelled task without bound waits for ever on one
    that catches the cancel and goes on. The stop waits its bound, then leaves it."""
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # as a library read that catches the cancel
            await release.wait()  # and reads again

    owned = OwnedTask("stubborn")
    owned.start(stubborn)
    await asyncio.sleep(0)
    await owned.stop(wait_s=0.05)  # returns: before, it never did
    assert not owned.done
    release.set()  # it ends by itself now
    await asyncio.sleep(0.01)
