"""The proxy's own hash of a KV-cache block: its token ids chained from its parent block's hash,
with the block's extra keys (vLLM's: the request's cache salt on the first block). vLLM's own
block hashes are not stable across its processes, so both sides of the prefix-cache index use
this one: the KV-event subscriber (``proxy.scheduling.kvindex``) for the blocks an engine
stored, the request layer (``proxy.request.prompt_blocks``) for a prompt's blocks.

Keyed BLAKE2b, 8 bytes: a key drawn per process (the hashes never leave it), so that no client
can aim a collision at another tenant's prefix; ~1 µs a block of 32 tokens.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from hashlib import blake2b

import msgspec

_KEY = os.urandom(16)
_ENCODE = msgspec.msgpack.Encoder()
NO_PARENT = 0  # the parent hash of a prompt's first block

ExtraKeys = Sequence[object] | None


def block_hash(parent: int, tokens: Sequence[int], extra: ExtraKeys = None) -> int:
    """The hash of one full block: ``tokens`` after the block whose hash is ``parent``.
    ``extra``: the block's extra keys as vLLM publishes them (None or empty: none)."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8, key=_KEY)
    # msgpack of a tuple and of a list are the same bytes: the salt the proxy folds in as a
    # tuple matches the list a decoded event carries.
    h.update(_ENCODE.encode(list(extra)) if extra else b"\xc0")
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: str = "", parent: int = NO_PARENT
) -> tuple[int, ...]:
    """The chained hashes of ``tokens``' full blocks (a last partial block is never cached),
    the cache salt folded into the first block as vLLM does (``extra_keys`` ``(salt,)``)."""
    hashes: list[int] = []
    first_extra: tuple[str, ...] | None = (salt,) if salt else None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(
            parent, tokens[start : start + block_size], first_extra if start == 0 else None
        )
        hashes.append(parent)
    return tuple(hashes)
