"""The prefix-cache index and the feed of KV-event batches into it: events injected as vLLM's
publisher encodes them (msgpack maps tagged by ``type`` in an array-like batch), an injected
clock, no sleeps."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from proxy.backends.backend import BackendState
from proxy.backends.kvevents import MAX_REPLAY_GAP, SLICE_BLOCKS, EventFeed, Sync, decode_batch
from proxy.backends.kvindex import KvIndex, Trust
from proxy.backends.kvsources import event_endpoint, event_endpoints
from proxy.config.backends import Backend
from proxy.policies.blockhash import chain_hashes
from tests.helpers.clock import FakeClock

B = 4  # block size of these tests


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def index(clock: FakeClock, max_blocks: int = 1000, resync_s: float = 30.0) -> KvIndex:
    return KvIndex(B, max_blocks, clock, resync_s)


def stored(
    hashes: list[Any], parent: Any, ids: list[int], extra: list[Any] | None = None, **kw: Any
) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": B,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    event.update(kw)
    return event


def batch(*events: dict[str, Any], ts: float = 0.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def test_stored_blocks_are_found_by_the_prompts_chain() -> None:
    idx = index(FakeClock())
    idx.store([11, 12, 13], None, tokens(12), None)
    prompt = chain_hashes(tokens(14), B)  # 3 full blocks, the same tokens
    assert idx.leading(prompt) == 3
    assert idx.leading(chain_hashes(tokens(8), B)) == 2
    other = chain_hashes([*tokens(4), 99, 98, 97, 96, *tokens(4, 8)], B)
    assert idx.leading(other) == 1  # a prefix: the chain stops at the first difference
    # A child stored later, chained from vLLM's hash of its parent.
    idx.store([14], 13, tokens(4, 12), None)
    assert idx.leading(chain_hashes(tokens(16), B)) == 4


def test_the_salt_in_the_first_block_separates_tenants() -> None:
    idx = index(FakeClock())
    idx.store([1, 2], None, tokens(8), [["salt-a"], None])
    assert idx.leading(chain_hashes(tokens(8), B, "salt-a")) == 2
    assert idx.leading(chain_hashes(tokens(8), B, "salt-b")) == 0
    assert idx.leading(chain_hashes(tokens(8), B)) == 0
    # The same tokens without a salt are another chain altogether.
    idx.store([3, 4], None, tokens(8), None)
    assert idx.leading(chain_hashes(tokens(8), B)) == 2


def test_removed_blocks_and_orphans() -> None:
    idx = index(FakeClock())
    idx.store([1, 2, 3], None, tokens(12), None)
    idx.remove([3, 999])  # an unknown hash is ignored
    assert idx.leading(chain_hashes(tokens(12), B)) == 2
    idx.remove([1])
    assert idx.leading(chain_hashes(tokens(12), B)) == 0
    # A child of a block the index never saw cannot be chained: not indexed.
    idx.store([7], 12345, tokens(4, 100), None)
    assert idx.stats.orphans == 1 and len(idx) == 1


def test_memory_is_bounded_oldest_first() -> None:
    idx = index(FakeClock(), max_blocks=3)
    idx.store([1, 2], None, tokens(8), None)
    idx.store([3, 4], None, tokens(8, 50), None)
    assert len(idx) == 3 and idx.stats.evicted == 1
    assert idx.leading(chain_hashes(tokens(8), B)) == 0  # its first block went first
    assert idx.leading(chain_hashes(tokens(8, 50), B)) == 2
    for n in range(100):
        idx.store([1000 + n], None, tokens(4, 200 + 4 * n), None)
        assert len(idx) <= 3
    idx.remove([1, 2, 3, 4])  # evicted ones are forgotten on both sides
    assert len(idx) == 3


def test_events_of_other_caches_are_not_indexed() -> None:
    clock = FakeClock()
    feed = EventFeed(index(clock), clock)
    feed.apply(
        0,
        decode_batch(
            batch(
                stored([1], None, tokens(4), medium="CPU"),
                stored([2], None, tokens(4), group_idx=1),
                stored([3], None, tokens(4), lora_id=1),  # an adapter without its name
                stored([4], None, tokens(8), block_size=8),
            )
        ),
    )
    assert len(feed.index) == 0


def test_a_feed_from_sequence_zero_is_warm_and_applies_in_order() -> None:
    clock = FakeClock()
    idx = index(clock)
    feed = EventFeed(idx, lambda: 105.0)
    assert not idx.warm()  # nothing heard yet
    applied = feed.apply(0, decode_batch(batch(stored([1, 2], None, tokens(8)), ts=100.0)))
    assert applied.sync == Sync.FIRST and applied.counts == {"BlockStored": 1}
    assert idx.warm() and feed.lag_s == 5.0
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    assert feed.apply(1, decode_batch(batch(removed))).sync == Sync.IN_ORDER
    assert idx.leading(chain_hashes(tokens(8), B)) == 1
    feed.apply(2, decode_batch(batch({"type": "AllBlocksCleared"})))
    assert len(idx) == 0 and idx.warm()


def test_a_gap_drops_the_index_and_it_stays_cold_for_resync_s() -> None:
    clock = FakeClock()
    idx = index(clock, resync_s=30.0)
    feed = EventFeed(idx, clock)
    feed.apply(0, decode_batch(batch(stored([1, 2], None, tokens(8)))))
    state = BackendState(cfg=Backend(url="http://b"), kv_index=idx)
    prompt = chain_hashes(tokens(9), B)
    assert state.cached_blocks(prompt) == 2
    applied = feed.apply(5, decode_batch(batch(stored([9], None, tokens(4, 40)))))
    assert applied.sync == Sync.GAP
    assert state.cached_blocks(prompt) is None  # cold
    assert len(idx) == 1  # what came after the gap is kept
    clock.advance(29.9)
    assert state.cached_blocks(prompt) is None
    clock.advance(0.1)
    assert state.cached_blocks(prompt) == 0  # the blocks from before the gap are gone
    assert state.cached_blocks(chain_hashes(tokens(5, 40), B)) == 1


def test_a_restarted_engine_clears_the_index() -> None:
    clock = FakeClock()
    idx = index(clock)
    feed = EventFeed(idx, clock)
    for seq in range(3):
        feed.apply(seq, decode_batch(batch(stored([seq + 1], None, tokens(4, 10 * seq)))))
    assert len(idx) == 3
    # The numbers begin again at 0: a new engine process, its cache empty; warm at once.
    applied = feed.apply(0, decode_batch(batch(stored([50], None, tokens(4, 500)))))
    assert applied.sync == Sync.RESTART and len(idx) == 1 and idx.warm()
    # Begun again, but its first batches missed: cold.
    feed.apply(3, decode_batch(batch()))
    assert feed.apply(1, decode_batch(batch())).sync == Sync.RESTART and not idx.warm()


def test_a_reconnect_is_cold_until_sequence_zero_or_resync() -> None:
    clock = FakeClock()
    idx = index(clock, resync_s=10.0)
    feed = EventFeed(idx, clock)
    feed.apply(0, decode_batch(batch(stored([1], None, tokens(4)))))
    feed.reconnected()
    assert len(idx) == 0 and not idx.warm()
    assert feed.apply(7, decode_batch(batch())).sync == Sync.GAP  # first heard: batch 7
    clock.advance(10.0)
    assert idx.warm()


def test_no_index_reads_none() -> None:
    assert BackendState(cfg=Backend(url="http://b")).cached_blocks((1, 2)) is None


def test_undecodable_payloads_raise_value_errors() -> None:
    with pytest.raises(ValueError):
        decode_batch(b"\x93\xa3abc")


@pytest.mark.parametrize(
    ("sources", "endpoint"),
    [
        (
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}},
            "tcp://10.1.2.3:5557",
        ),
        (
            {
                "0": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": "tcp://10.1.2.3:6000",
                }
            },
            "tcp://10.1.2.3:6000",
        ),
        # Only the backend's own host: never another one, nor a socket on the proxy's host.
        *(
            ({"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": e}}, None)
            for e in ("tcp://10.9.9.9:6000", "ipc:///tmp/x.sock", "inproc://x", "tcp://h:1:x")
        ),
        ({"0": {"enable_kv_cache_events": False, "publisher": "null"}}, None),
        ({}, None),
        (
            {
                "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:1"},
                "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:2"},
            },
            None,
        ),
        ([], None),
    ],
)
def test_event_endpoint_from_kv_event_sources(sources: object, endpoint: str | None) -> None:
    assert event_endpoint(sources, "http://10.1.2.3:8000") == endpoint


def test_the_first_batch_after_a_reconnect_does_not_restart_the_resync() -> None:
    clock = FakeClock()
    idx = index(clock, resync_s=10.0)
    feed = EventFeed(idx, clock)
    feed.reconnected()
    feed.connected()  # the connection is up: partial from here, used after resync_s
    clock.advance(6.0)
    feed.apply(40, decode_batch(batch(stored([1], None, tokens(4)))))
    clock.advance(4.0)
    assert idx.warm() and idx.leading(chain_hashes(tokens(5), B)) == 1
    # A gap later on drops it again.
    feed.apply(42, decode_batch(batch()))
    assert not idx.warm() and len(idx) == 0


def test_the_replay_endpoint_comes_with_the_publishers() -> None:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
    }
    found = event_endpoints({"0": config}, "http://[::1]:8000")
    assert found == ("tcp://[::1]:5557", "tcp://[::1]:5558")
    assert event_endpoints({"0": {**config, "replay_endpoint": None}}, "http://h:1") == (
        "tcp://h:5557",
        None,
    )
    # A replay endpoint off the backend's host is refused (and said so); the publisher stays.
    refused: list[str] = []
    odd = {**config, "replay_endpoint": "ipc:///run/other.sock"}
    assert event_endpoints({"0": odd}, "http://h:1", refused) == ("tcp://h:5557", None)
    assert refused == ["ipc:///run/other.sock"]
    # A replay buffer that keeps nothing (``buffer_steps: 0``): an empty history from it would
    # say nothing of what the engine stored, so it is not used.
    keeps_none = {"0": {**config, "buffer_steps": 0}}
    assert event_endpoints(keeps_none, "http://h:1") == ("tcp://h:5557", None)
    assert event_endpoints({"0": {**config, "buffer_steps": 10_000}}, "http://h:1") == (
        "tcp://h:5557",
        "tcp://h:5558",
    )


def test_an_empty_history_makes_a_new_connections_index_exact_and_the_next_batch_its_first() -> (
    None
):
    clock = FakeClock()
    idx = index(clock, resync_s=30.0)
    feed = EventFeed(idx, clock)
    feed.reconnected()
    feed.connected()
    assert idx.trust() == Trust.COLD  # partial, but within resync_s
    feed.history_empty()  # the engine never published a batch: it stored nothing
    assert idx.trust() == Trust.EXACT
    assert feed.apply(0, decode_batch(batch(stored([1], None, tokens(4))))).sync == Sync.IN_ORDER
    assert idx.trust() == Trust.EXACT and idx.leading(chain_hashes(tokens(5), B)) == 1
    # Were its first batches missed meanwhile, they are a gap from 0, asked of the replay.
    other = EventFeed(index(clock), clock)
    other.reconnected()
    other.connected()
    other.history_empty()
    assert other.missing_from(0) is None and other.missing_from(3) == 0
    # Once a batch was heard on the connection, an empty answer changes nothing.
    late = EventFeed(index(clock, resync_s=0.0), clock)
    late.reconnected()
    late.connected()
    late.apply(7, decode_batch(batch(stored([1], None, tokens(4)))))
    late.history_empty()
    assert late.index.trust() == Trust.PARTIAL and late.last_seq == 7


def test_what_a_replay_must_bring() -> None:
    clock = FakeClock()
    feed = EventFeed(index(clock), clock)
    assert feed.missing_from(0) is None and feed.missing_from(5) == 0  # nothing heard yet
    feed.apply(0, decode_batch(batch()))
    assert feed.missing_from(1) is None and feed.missing_from(4) == 1
    # Never more than a replay buffer holds (10,000 batches): a longer gap goes cold at once,
    # and a long-running engine heard on a new connection is not asked from 0.
    assert feed.missing_from(2 + MAX_REPLAY_GAP) is None and feed.missing_from(2**62) is None
    feed.reconnected()
    assert feed.missing_from(MAX_REPLAY_GAP) == 0 and feed.missing_from(MAX_REPLAY_GAP + 1) is None


def test_events_not_of_vllms_shapes_are_skipped() -> None:
    """A fat or unhashable block hash, a token id past 64 bits, more tokens than the blocks
    hold: refused, counted, never stored (nor raised: they once killed the subscriber)."""
    clock = FakeClock()
    idx = index(clock)
    feed = EventFeed(idx, clock)
    odd = [
        stored([b"x" * 100_000], None, tokens(4)),
        stored([[1, 2]], None, tokens(4)),
        stored(["a str"], None, tokens(4)),
        stored([3], None, [2**63, 1, 2, 3]),
        stored([4], None, tokens(8)),
        stored([5], [6, 7], tokens(4)),
        {"type": "BlockRemoved", "block_hashes": [[1]], "medium": "GPU"},
    ]
    applied = feed.apply(0, decode_batch(batch(*odd, stored([b"h" * 32], None, tokens(4)))))
    assert applied.refused == len(odd) and len(idx) == 1
    assert idx.leading(chain_hashes(tokens(5), B)) == 1


def test_a_big_batch_is_applied_in_slices() -> None:
    """The subscriber lets the event loop run between slices; the blocks of one long event,
    stored a slice at a time, still chain as one."""
    clock = FakeClock()
    idx = index(clock, max_blocks=10 * SLICE_BLOCKS)
    feed = EventFeed(idx, clock)
    n = 2 * SLICE_BLOCKS + 5
    long = stored(list(range(1, n + 1)), None, tokens(n * B))
    applied = feed.apply(0, decode_batch(batch()))
    many = batch(
        long, *(stored([10**6 + i], None, tokens(B, 10**6 + B * i)) for i in range(SLICE_BLOCKS))
    )
    pauses = sum(1 for _ in feed.steps(applied, decode_batch(many)))
    assert 3 <= pauses <= 5  # about one a SLICE_BLOCKS blocks or events
    assert idx.leading(chain_hashes(tokens(n * B), B)) == n and len(idx) == n + SLICE_BLOCKS
