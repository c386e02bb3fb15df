"""How a request whose client left reaches the backend chooser (the pipeline's forward releases
its lease with ``ran``): before the engine answered, ``None`` (it may have waited in vLLM's own
queue: kv_aware tells by its index, proxy.policies.kvleft); after the stream's first event,
run; answered, run. The pipeline as the app wires it (a client that leaves cancels its
handler), on the fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import until
from proxy.policies.types import BackendView, QueuedRequest
from tests.helpers.clock import FakeClock
from tests.unit.request.test_cut_nonstream_billing import leave_while, rig, send


def _recorded(state: Any) -> list[bool | None]:
    """What the chooser is told of each request's end."""
    seen: list[bool | None] = []
    chooser = state.pool.chooser

    def ended(s: BackendView, request: QueuedRequest | None, ran: bool | None) -> None:
        seen.append(ran)

    chooser.ended = ended
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_a_client_that_leaves_before_the_engine_answers_is_neither_run_nor_not(
    clock: FakeClock, stream: bool
) -> None:
    backend = FakeVLLM(usage=(7, 3))
    backend.gate.clear()  # the engine has it (queued or computing): no byte yet
    async with backend.serve() as url, rig(url, clock, []) as (state, client):
        seen = _recorded(state)
        await leave_while(client, lambda: backend.active == 1, stream=stream)
        await until(lambda: bool(seen), 5, "the lease released")
        assert seen == [None]
        backend.gate.set()
        assert (await send(client, stream=stream)).status == 200  # answered: run
        await until(lambda: len(seen) == 2, 5, "the second lease released")
        assert seen == [None, True]


async def test_a_client_that_leaves_after_the_streams_first_event_ran(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=(7, 3), stream_chunks=50, delay_per_token_s=0.01)
    async with backend.serve() as url, rig(url, clock, []) as (state, client):
        seen = _recorded(state)
        answer = await send(client, stream=True, max_tokens=200)
        assert answer.status == 200
        await answer.content.readline()  # its first event: the engine computed its prefill
        answer.close()
        await until(lambda: bool(seen), 5, "the lease released")
        assert seen == [True]
