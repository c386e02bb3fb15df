"""Missed KV-event batches asked again from vLLM's replay socket (``replay_endpoint`` of its
publisher: a ROUTER that answers a start sequence number with every batch it still buffers from
there, ``buffer_steps`` of them at most, then an end marker of sequence -1).

Used by the subscriber (``proxy.scheduling.kvsubscriber``) on a gap: when the buffer still holds
every missed batch, they are applied in order and the index never goes cold.
"""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from proxy.scheduling.kvevents import EventBatch, decode_batch, sequence_number

_END = -1


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, until: int, timeout_s: float
) -> list[tuple[int, EventBatch]] | None:
    """Batches ``start`` .. ``until - 1``, in order, or None: the publisher no longer holds
    them all, did not answer within ``timeout_s``, or sent something else."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        got: list[tuple[int, EventBatch]] = []
        async with asyncio.timeout(timeout_s):
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    return None
                seq = sequence_number(frames[-2])
                if seq == _END:
                    break
                if start <= seq < until:  # later ones come live
                    got.append((seq, decode_batch(frames[-1])))
    except (TimeoutError, msgspec.DecodeError, zmq.ZMQError):
        return None
    finally:
        sock.close(linger=0)
    if [seq for seq, _ in got] != list(range(start, until)):
        return None
    return got
