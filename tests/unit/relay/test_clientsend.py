"""ClientSender's read-ahead: a lagging client's connection holds more unsent, reserved from the
memory budget, and gives it back in bounded steps once the upstream has ended. A fake transport
plays the socket's write buffer: what the client reads is moved by the test, never by time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.relay.budget import MemoryBudget
from proxy.relay.clientsend import ClientSender, ClientStalled

KIB = 1024
OWN = (16 * KIB, 64 * KIB)  # asyncio's own (low, high)


@dataclass
class FakeTransport:
    """A write buffer with asyncio's flow control: paused above ``high``, resumed at ``low``."""

    size: int = 0
    low: int = OWN[0]
    high: int = OWN[1]
    closing: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    limits: list[tuple[int, int]] = field(default_factory=list)  # every change, (low, high)

    def __post_init__(self) -> None:
        self.resumed.set()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.low, self.high

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        assert 0 <= low <= high
        self.low, self.high = low, high
        self.limits.append((low, high))
        self._flow()

    def get_write_buffer_size(self) -> int:
        return self.size

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing, self.size = True, 0

    def write(self, n: int) -> None:
        self.size += n
        self._flow()

    def client_reads(self, n: int) -> None:
        self.size = max(self.size - n, 0)
        self._flow()

    def _flow(self) -> None:
        if self.size > self.high:
            self.resumed.clear()
        elif self.size <= self.low:
            self.resumed.set()


class FakeOut:
    """The response: a write lands in the buffer, then waits while it is paused (aiohttp's)."""

    def __init__(self, transport: FakeTransport) -> None:
        self.transport = transport

    async def write(self, data: bytes) -> None:
        self.transport.write(len(data))
        await self.transport.resumed.wait()

    async def write_eof(self) -> None:
        await self.transport.resumed.wait()


def sender(
    transport: FakeTransport,
    *,
    read_ahead: int = 256 * KIB,
    budget: Any = None,
    idle_s: float = 60,
    deadline_in: float = 120,
) -> tuple[ClientSender, Any]:
    writer = SimpleNamespace(drain=transport.resumed.wait)
    request = SimpleNamespace(transport=transport, writer=writer)
    deadline = asyncio.get_running_loop().time() + deadline_in
    send = ClientSender(request, deadline, idle_s, read_ahead, budget)  # type: ignore[arg-type]
    return send, FakeOut(transport)


async def test_a_lagging_client_gets_the_read_ahead_reserved_from_the_budget() -> None:
    transport, budget = FakeTransport(size=60 * KIB), MemoryBudget(1024 * KIB)
    send, out = sender(transport, budget=budget)
    await send.write(out, b"x" * 10 * KIB)  # past the connection's own mark: widened, no wait
    assert transport.size == 70 * KIB and budget.held == 256 * KIB
    # The connection's own hysteresis kept: a paused write resumes after 48 KiB read, as before.
    assert transport.get_write_buffer_limits() == (208 * KIB, 256 * KIB)
    await send.write(out, b"x" * 150 * KIB)
    assert transport.size == 220 * KIB and transport.resumed.is_set()
    send.close()
    assert budget.held == 0 and transport.get_write_buffer_limits() == OWN


async def test_settle_drains_to_the_own_mark_in_steps_and_gives_everything_back() -> None:
    transport, budget = FakeTransport(size=60 * KIB), MemoryBudget(1024 * KIB)
    send, out = sender(transport, budget=budget)
    await send.write(out, b"x" * 190 * KIB)
    settling = asyncio.create_task(send.settle())
    await asyncio.sleep(0)
    assert not settling.done() and not transport.resumed.is_set()  # paused at once
    while not settling.done():
        transport.client_reads(48 * KIB)  # each step: the own hysteresis read
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await settling
    assert transport.size <= OWN[1]
    assert transport.get_write_buffer_limits() == OWN and budget.held == 0
    # One step per 48 KiB the client read: 250 KiB held, down to 64 KiB.
    assert len(transport.limits) - 2 == 4


async def test_past_the_deadline_what_the_read_ahead_holds_and_the_last_event_still_go_out() -> (
    None
):
    """A stream cut at its deadline (vLLM still generating, a steady but slow reader behind):
    the client reads what was held, then the error event and the end, each step within the
    idle bound. Bounded by the deadline, the first wait aborted the connection with the event
    unsent (red team of stop 55)."""
    transport = FakeTransport(size=60 * KIB)
    send, out = sender(transport, deadline_in=-1)  # the deadline has passed
    send._widen(0)  # widened while the stream ran (its writes were within the deadline)
    transport.write(130 * KIB)
    finishing = asyncio.create_task(send.finish(out, b"data: {error}\n\ndata: [DONE]\n\n"))
    while not finishing.done():
        transport.client_reads(8 * KIB)  # slow and steady
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await finishing
    assert not transport.closing and transport.get_write_buffer_limits() == OWN


async def test_a_client_that_stops_reading_while_it_settles_is_cut() -> None:
    transport, budget = FakeTransport(size=60 * KIB), MemoryBudget(1024 * KIB)
    send, out = sender(transport, budget=budget, idle_s=0)  # each step's bound: already past
    await send.write(out, b"x" * 100 * KIB)
    with pytest.raises(ClientStalled):
        await send.finish(out, b"data: [DONE]\n\n")
    assert transport.closing and budget.held == 0


@pytest.mark.parametrize("read_ahead", [0, 64 * KIB])
async def test_no_read_ahead_where_it_would_not_pass_the_own_mark(read_ahead: int) -> None:
    transport = FakeTransport(size=60 * KIB)
    send, out = sender(transport, read_ahead=read_ahead, idle_s=0)
    with pytest.raises(ClientStalled):  # it waited as before, and its bound cut it
        await send.write(out, b"x" * 10 * KIB)
    assert transport.limits == []


async def test_past_the_budgets_half_a_stream_lags_as_before() -> None:
    budget = MemoryBudget(400 * KIB)
    other = budget.try_reserve(100 * KIB)  # with 256 KiB more: past half of 400
    assert other is not None
    transport = FakeTransport(size=60 * KIB)
    send, out = sender(transport, budget=budget, idle_s=0)
    with pytest.raises(ClientStalled):
        await send.write(out, b"x" * 10 * KIB)
    assert budget.held == 100 * KIB and transport.limits == []
