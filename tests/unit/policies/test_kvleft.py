"""kv_aware and a request whose client left before the engine answered (``ended(ran=None)``,
proxy.policies.kvleft): told by the backend's index whether the engine stored any of its
prompt, within ``pending_s``. An injected clock, no sleep."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.config.backends import Backend
from proxy.policies.backends import Candidate
from proxy.policies.kvaware import KvAware
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import QueuedRequest
from tests.helpers.clock import FakeClock
from tests.unit.policies.test_kvaware import FakeBackend

BLOCK = 32
WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=4.0, worst=0.25)
SYSTEM = (1, 2, 3, 4)


def _req(blocks: Sequence[int], tenant: str = "t") -> QueuedRequest:
    req = QueuedRequest("normal", tenant, BLOCK * len(blocks) + 10, 16, arrival_s=0.0)
    req.prompt_blocks = tuple(blocks)
    return req


def _rig() -> tuple[FakeClock, KvAware, FakeBackend, FakeBackend]:
    clock = FakeClock()
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, clock=clock, max_share=1.0)
    return clock, chooser, FakeBackend(Backend(url="http://a:80")), FakeBackend(Backend(url="http://b:80"))  # fmt: skip


def _look(chooser: KvAware, *backends: FakeBackend) -> FakeBackend | None:
    """A pick (what settles the requests whose clients left), of a new tenant's prompt."""
    cands = [Candidate(b, b.max_room - b.inflight, None) for b in backends]
    return chooser.pick(cands, _req([900, 901], tenant="other"))


def _left(chooser: KvAware, on: FakeBackend, blocks: Sequence[int]) -> QueuedRequest:
    req = _req(blocks)
    chooser.served(on, req)
    chooser.ended(on, req, ran=None)  # its client left before the engine answered
    return req


def test_a_request_left_while_queued_in_vllm_leaves_no_trace_once_its_wait_is_over() -> None:
    clock, chooser, a, b = _rig()
    _left(chooser, a, [*SYSTEM, 10])  # the index (warm, empty) never shows its blocks
    assert chooser.memory.in_flight() == 1  # meanwhile in flight, as it was
    clock.advance(9.0)
    _look(chooser, a, b)
    assert chooser.memory.in_flight() == 1  # its blocks' events could still come
    clock.advance(1.0)  # pending_s (10 s) after it left, nothing stored: it did not run
    _look(chooser, a, b)
    assert chooser.memory.in_flight() == 0 and chooser.memory.kept_by_tenant() == {}
    assert chooser.memory.home([*SYSTEM, 10]) == (None, 0)
    assert chooser._filled.shares(at_least=0) == {}  # out of the shares lately: nothing sent counts


def test_a_request_whose_prompt_the_index_shows_stored_ran() -> None:
    clock, chooser, a, b = _rig()
    a.cached = {1, 2}  # cached when it was sent
    _left(chooser, a, [*SYSTEM, 10])
    clock.advance(2.0)
    a.cached |= {3}  # its prefill stored a block past those: it reached the engine's compute
    _look(chooser, a, b)
    assert chooser.memory.in_flight() == 0 and chooser.memory.kept_by_tenant() == {"t": 5}
    assert chooser.memory.home([*SYSTEM, 10, 11]) == ("http://a:80", 5)


def test_what_cannot_be_told_counts_as_run_at_once() -> None:
    _, chooser, a, b = _rig()
    a.cached = None  # a cold index tells nothing
    _left(chooser, a, [*SYSTEM, 10])
    b.cached = set(SYSTEM)  # a prompt held whole when sent: nothing new to store
    _left(chooser, b, SYSTEM)
    assert chooser.memory.in_flight() == 0
    assert chooser.memory.kept_by_tenant() == {"t": 9}
    # Gone cold while it waited: as any request that may have run.
    c = FakeBackend(Backend(url="http://c:80"))
    _left(chooser, c, [*SYSTEM, 20])
    c.cached = None
    _look(chooser, b)
    assert chooser.memory.in_flight() == 0 and chooser.memory.kept_by_tenant() == {"t": 14}
