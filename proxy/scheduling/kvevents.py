"""vLLM's KV events as they come off its ZMQ publisher, and what each batch does to a backend's
index (``proxy.scheduling.kvindex``). No I/O here: ``proxy.scheduling.kvsubscriber`` receives.

The wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): each message is the frames
``(topic, seq, payload)``, ``seq`` an 8-byte big-endian sequence number counted from 0 by each
publisher (so a new engine process starts again at 0), ``payload`` a msgpack ``EventBatch``
``[ts, [events], data_parallel_rank]`` whose events are maps tagged by ``type``. The structs below
mirror vLLM's with defaults for every field the proxy does not need, so that a newer vLLM's
extra fields decode too (msgspec ignores unknown fields).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from proxy.scheduling.kvindex import KvIndex


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)
# The device's own cache: offloaded copies (another medium) and other KV-cache groups (hybrid
# models) are not what a request's prefix hits first.
_DEVICE_MEDIA = (None, "GPU")


def decode_batch(payload: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything else."""
    return _DECODER.decode(payload)


def sequence_number(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class Sync:
    """What a batch's sequence number says about the index."""

    IN_ORDER = "in_order"
    FIRST = "first"  # the publisher's first batch: the index starts complete
    GAP = "gap"  # batches were missed
    RESTART = "restart"  # the numbers began again: a new engine process


@dataclass
class Applied:
    sync: str
    counts: dict[str, int]  # events applied by kind


class EventFeed:
    """One backend's stream of batches, checked for order and applied to its index."""

    def __init__(self, index: KvIndex, wall: Callable[[], float]) -> None:
        self.index = index
        self.wall = wall
        self.last_seq: int | None = None  # None: nothing received on this connection yet
        self.lag_s: float | None = None

    def reconnected(self) -> None:
        """A new connection (or the old one dropped): batches may have been missed meanwhile;
        the next batch decides whether the index starts complete (sequence 0) or cold."""
        self.last_seq = None
        self.index.lost_sync()

    def missing_from(self, seq: int) -> int | None:
        """The first batch missed before ``seq`` (which a replay could bring); None: none."""
        last = self.last_seq
        if last is None:
            return 0 if seq > 0 else None
        return last + 1 if seq > last + 1 else None

    def check(self, seq: int) -> str:
        last, self.last_seq = self.last_seq, seq
        if last is None:
            if seq == 0:
                self.index.synced_from_start()
                return Sync.FIRST
            # Batches before this one were missed, but the index was dropped when the
            # connection began (``reconnected``): it only lacks blocks; its resync runs on.
            return Sync.GAP
        if seq == last + 1:
            return Sync.IN_ORDER
        if seq <= last:
            if seq == 0:
                self.index.synced_from_start()
            else:
                self.index.lost_sync()
            return Sync.RESTART
        self.index.lost_sync()
        return Sync.GAP

    def apply(self, seq: int, batch: EventBatch) -> Applied:
        sync = self.check(seq)
        counts: dict[str, int] = {}
        index = self.index
        for event in batch.events:
            kind = type(event).__name__
            if isinstance(event, BlockStored):
                if not self._indexed(event):
                    continue
                index.store(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.extra_keys
                )
            elif isinstance(event, BlockRemoved):
                if event.medium not in _DEVICE_MEDIA or event.group_idx not in (None, 0):
                    continue
                index.remove(event.block_hashes)
            else:
                index.clear()
            counts[kind] = counts.get(kind, 0) + 1
        self.lag_s = max(0.0, self.wall() - batch.ts)
        return Applied(sync, counts)

    def _indexed(self, event: BlockStored) -> bool:
        """Blocks a plain prompt of the base model can hit on the device."""
        return (
            event.block_size == self.index.block_size
            and event.medium in _DEVICE_MEDIA
            and event.group_idx in (None, 0)
            and event.lora_name is None
            and event.lora_id is None
        )
