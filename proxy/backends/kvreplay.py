"""Missed KV-event batches asked again from vLLM's replay socket (``replay_endpoint`` of its
publisher: a ROUTER that answers a start sequence number with every batch it still buffers from
there, ``buffer_steps`` of them at most, then an end marker of sequence -1).

Used by the subscriber (``proxy.backends.kvsubscriber``) on a gap: when the buffer still holds
every missed batch, they are applied in order and the index never goes cold.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from proxy.backends.kvevents import MAX_REPLAY_GAP, EventBatch, decode_batch, sequence_number

_END = -1


class ReplayUnanswered(Exception):
    """The replay socket sent nothing within the timeout (an engine too busy to answer in
    time, or none listening yet): unlike a refusal, asking again may bring the batches."""


# What one replay may bring in all: vLLM's batches are KBs each, its buffer 10,000 of them.
REPLAY_MAX_BYTES = 64 * 1024 * 1024


async def replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    until: int | None,
    timeout_s: float,
    max_msg_bytes: int,
) -> list[tuple[int, EventBatch]] | None:
    """Batches ``start`` .. ``until - 1`` (None: every one it holds from ``start``), in order,
    or None: the publisher no longer holds them all (from ``start``), sent something else or
    too much, or the gap is longer than any replay buffer (not asked). Raises
    ``ReplayUnanswered`` where it did not answer within ``timeout_s``. Memory: the batches
    kept, never the range."""
    if until is not None and (not 0 <= start < until or until - start > MAX_REPLAY_GAP):
        return None
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    got: list[tuple[int, EventBatch]] = []
    expected, size = start, 0
    try:
        sock.connect(endpoint)
        async with asyncio.timeout(timeout_s):
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    return None
                seq = sequence_number(frames[-2])
                if seq is None:
                    return None
                if seq == _END:
                    break
                if until is not None and seq >= until:  # later ones come live
                    continue
                size += len(frames[-1])
                if seq != expected or size > REPLAY_MAX_BYTES or len(got) >= MAX_REPLAY_GAP:
                    return None  # not what a replay buffer holds: in order, none skipped
                got.append((seq, decode_batch(frames[-1])))
                expected += 1
    except TimeoutError:
        raise ReplayUnanswered(f"no answer within {timeout_s:g} s") from None
    except (ValueError, zmq.ZMQError):  # msgspec.DecodeError is a ValueError
        return None
    finally:
        sock.close(linger=0)
    return got if until is None or expected == until else None
