"""vLLM's KV events as they come off its ZMQ publisher, and what each batch does to a backend's
index (``proxy.backends.kvindex``). No I/O here: ``proxy.backends.kvsubscriber`` receives.

The wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): each message is the frames
``(topic, seq, payload)``, ``seq`` an 8-byte big-endian sequence number counted from 0 by each
publisher (so a new engine process starts again at 0), ``payload`` a msgpack ``EventBatch``
``[ts, [events], data_parallel_rank]`` whose events are maps tagged by ``type``. The structs below
mirror vLLM's with defaults for every field the proxy does not need, so that a newer vLLM's
extra fields decode too (msgspec ignores unknown fields).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proxy.backends.kvindex import KvIndex
from proxy.policies.blockhash import token_ids_ok


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


# vLLM's replay buffer holds 10,000 batches (``buffer_steps``): a gap longer than that cannot be
# replayed, and is never asked for (the index goes cold at once).
MAX_REPLAY_GAP = 10_000
# Blocks applied between two looks at the event loop: a big batch never stalls it (~1 ms each).
SLICE_BLOCKS = 1_000
_HASH_BYTES = 64  # vLLM's bytes hashes are 32 (sha256); ints are 64-bit


def decode_batch(payload: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything else."""
    return _DECODER.decode(payload)


def sequence_number(frame: bytes) -> int | None:
    """vLLM's 8-byte big-endian sequence number; None: not one."""
    if len(frame) != 8:
        return None
    return int.from_bytes(frame, "big", signed=True)


def _vllm_hash(h: object) -> bool:
    """vLLM's ``ExternalBlockHash``: an int within 64 bits, or a short bytes string. Anything
    else (a list, a 100 KB string) is refused: unhashable, or heavy to keep in the index."""
    if type(h) is int:
        return -(2**63) <= h < 2**64
    return type(h) is bytes and len(h) <= _HASH_BYTES


def _valid_hashes(hashes: list[Any]) -> bool:
    return all(_vllm_hash(h) for h in hashes)


def _valid_store(event: BlockStored, block_size: int) -> bool:
    """What is cheap to check of a ``BlockStored`` as a whole: its parent's hash, at most
    ``block_size`` token ids a block (the hashes and the ids are checked a slice at a time)."""
    parent = event.parent_block_hash
    return (parent is None or _vllm_hash(parent)) and len(event.token_ids) <= len(
        event.block_hashes
    ) * block_size


class Sync:
    """What a batch's sequence number says about the index."""

    IN_ORDER = "in_order"
    FIRST = "first"  # the publisher's first batch: the index starts complete
    GAP = "gap"  # batches were missed
    RESTART = "restart"  # the numbers began again: a new engine process


@dataclass
class Applied:
    sync: str
    counts: dict[str, int] = field(default_factory=dict)  # events applied by kind
    refused: int = 0  # events not of vLLM's shapes, skipped


class EventFeed:
    """One backend's stream of batches, checked for order and applied to its index."""

    def __init__(self, index: KvIndex, wall: Callable[[], float]) -> None:
        self.index = index
        self.wall = wall
        self.last_seq: int | None = None  # None: nothing received on this connection yet
        self.lag_s: float | None = None

    def reconnected(self) -> None:
        """A new connection opening (or the old one dropped): batches may be missed meanwhile;
        the index is cold until the connection is up (``connected``) or a batch comes."""
        self.last_seq = None
        self.index.dropped()

    def connected(self) -> None:
        """The connection is up: the (empty) index hears every batch from here: partial."""
        self.index.joined()

    def history_empty(self) -> None:
        """The engine's replay, asked from its first batch on a new connection before any
        batch came, holds none: it never published one (vLLM publishes a batch only of a step
        with events, and its buffer, once it holds one, is never empty again: 0.32's
        ZmqEventPublisher), so it has stored nothing, and the (empty) index is exact. Its next
        batch is its first (sequence 0); a later one is a gap from 0, replayed."""
        if self.last_seq is None:
            self.index.synced_from_start()
            self.last_seq = -1

    def missing_from(self, seq: int) -> int | None:
        """The first batch missed before ``seq`` that a replay could bring; None: none, or
        more than the engine's replay buffer holds (never asked: the index is dropped). On a
        new connection only a replay from the engine's first batch makes the index exact
        (what came before any later start is unknown anyway), so one is asked only of an
        engine young enough that its buffer may still hold all it published; a long-running
        engine's index stays partial instead (it only lacks what was stored before)."""
        last = self.last_seq
        start = 0 if last is None else last + 1
        if seq <= start or seq - start > MAX_REPLAY_GAP:
            return None
        return start

    def check(self, seq: int) -> str:
        last, self.last_seq = self.last_seq, seq
        if last is None:
            if seq == 0:
                self.index.synced_from_start()
                return Sync.FIRST
            # Batches before this one were missed, but the index was dropped when the
            # connection began (``reconnected``): it only lacks blocks: partial.
            self.index.joined()
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
        """The whole batch at once (tests, small batches)."""
        applied = Applied(self.check(seq))
        for _ in self.steps(applied, batch):
            pass
        return applied

    def steps(self, applied: Applied, batch: EventBatch) -> Iterator[None]:
        """Applies ``batch`` (its sequence number already ``check``-ed into ``applied``),
        pausing (a ``yield``) after about ``SLICE_BLOCKS`` blocks or events, so that the
        subscriber lets the event loop run between slices. Events not of vLLM's shapes (block
        hashes, token ids, checked a slice at a time) are refused from where they fail: a
        store cut short only under-predicts, a removal of a hash the index cannot hold removes
        nothing."""
        counts = applied.counts
        index = self.index
        done = 0
        for event in batch.events:
            done += 1
            ok = True
            if isinstance(event, BlockStored):
                if not _valid_store(event, index.block_size):
                    ok = False
                elif self._indexed(event):
                    for n in self._store(event):
                        if n == 0:
                            ok = False
                            break
                        done += n
                        if done >= SLICE_BLOCKS:
                            done = 0
                            yield
            elif isinstance(event, BlockRemoved):
                if event.medium in _DEVICE_MEDIA and event.group_idx in (None, 0):
                    hashes = event.block_hashes
                    for i in range(0, len(hashes), SLICE_BLOCKS):
                        part = hashes[i : i + SLICE_BLOCKS]
                        if not _valid_hashes(part):
                            ok = False
                            break
                        index.remove(part)
                        done += len(part)
                        if done >= SLICE_BLOCKS:
                            done = 0
                            yield
            else:
                index.all_cleared()  # exact from here, whatever was missed before
            if ok:
                kind = type(event).__name__
                counts[kind] = counts.get(kind, 0) + 1
            else:
                applied.refused += 1
            if done >= SLICE_BLOCKS:
                done = 0
                yield
        self.lag_s = max(0.0, self.wall() - batch.ts)

    def _store(self, event: BlockStored) -> Iterator[int]:
        """Stores the event's blocks a slice at a time (each slice chained from the last block
        of the one before, as vLLM's own parent); yields the blocks of each slice, 0 for one
        not of vLLM's shapes (nothing of it stored)."""
        hashes, tokens, size = event.block_hashes, event.token_ids, self.index.block_size
        extra = event.extra_keys
        parent = event.parent_block_hash
        for i in range(0, len(hashes), SLICE_BLOCKS):
            part = hashes[i : i + SLICE_BLOCKS]
            ids = tokens[i * size : (i + len(part)) * size]
            if not (_valid_hashes(part) and token_ids_ok(ids)):
                yield 0
                return
            keys = extra[i : i + SLICE_BLOCKS] if extra is not None else None
            self.index.store(part, parent, ids, keys)
            parent = part[-1]
            yield len(part)

    def _indexed(self, event: BlockStored) -> bool:
        """Blocks a prompt can hit on the device: the base model's, and a LoRA adapter's keyed by
        its name (in each block's extra keys, as the proxy hashes an adapter request's prompt:
        ``proxy.policies.blockhash.BlockKeys``; ``lora_id`` changes at every reload). An
        adapter's block without its name could never be matched."""
        return (
            event.block_size == self.index.block_size
            and event.medium in _DEVICE_MEDIA
            and event.group_idx in (None, 0)
            and (event.lora_name is not None or event.lora_id is None)
        )
