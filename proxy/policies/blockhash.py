"""The proxy's own hash of a KV-cache block: its token ids chained from its parent block's hash,
with the block's extra keys (vLLM's: the request's cache salt on the first block). vLLM's own
block hashes are not stable across its processes, so both sides of the prefix-cache index use
this one: the KV-event subscriber (``proxy.backends.kvindex``) for the blocks an engine
stored, the request layer (``proxy.request.prompt_blocks``) for a prompt's blocks.

Keyed BLAKE2b, 8 bytes: a key drawn per process (the hashes never leave it), so that no client
can aim a collision at another tenant's prefix; ~1 µs a block of 32 tokens.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import NamedTuple

import msgspec

_KEY = os.urandom(16)
_KEYED = blake2b(digest_size=8, key=_KEY)  # copied per block: cheaper than keying each anew
_ENCODE = msgspec.msgpack.Encoder()
_NO_EXTRA = b"\xc0"  # msgpack nil
NO_PARENT = 0  # the parent hash of a prompt's first block
# Token ids a block may hold: vLLM's are int32 (its input_ids); anything past 2**63 does not
# even pack (OverflowError in ``chain``). Ids from outside (a client, a backend's /tokenize
# answer, a KV event) are checked against this before they are hashed.
TOKEN_ID_LIMIT = 2**32

ExtraKeys = Sequence[object] | None


def token_ids_ok(tokens: object) -> bool:
    """A list of plain ints in ``0 .. TOKEN_ID_LIMIT - 1``."""
    return isinstance(tokens, list) and all(
        type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in tokens
    )


def chain(
    parent: int,
    tokens: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKeys] | None = None,
) -> list[int]:
    """The chained hashes of ``tokens``' full blocks after the block whose hash is ``parent``
    (a last partial block is never cached). ``extra_keys``: each block's extra keys as vLLM
    publishes them (None, or an entry None or empty: none). The tokens are packed once."""
    packed = memoryview(array("q", tokens))
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        h = _KEYED.copy()
        h.update(parent.to_bytes(8, "little"))
        # msgpack of a tuple and of a list are the same bytes: the salt the proxy folds in as a
        # tuple matches the list a decoded event carries.
        h.update(_ENCODE.encode(list(extra)) if extra else _NO_EXTRA)
        h.update(packed[i * block_size : (i + 1) * block_size])
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes


class BlockKeys(NamedTuple):
    """What vLLM folds into a prompt's blocks besides its tokens: the LoRA adapter's name in
    every block, then the cache salt in the first (its ``extra_keys``: ``(adapter, salt)``,
    ``(adapter,)``, ...; without an adapter ``(salt,)``, then none)."""

    salt: str = ""
    adapter: str | None = None

    def extra_keys(self, blocks: int) -> list[tuple[str, ...]] | None:
        if self.adapter is None:
            return [(self.salt,)] if self.salt else None
        first: tuple[str, ...] = (self.adapter, self.salt) if self.salt else (self.adapter,)
        return [first] + [(self.adapter,)] * (blocks - 1)


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: str | BlockKeys = ""
) -> tuple[int, ...]:
    """A prompt's chained block hashes, the cache salt (and the adapter: ``BlockKeys``) folded
    in as vLLM does."""
    keys = salt if isinstance(salt, BlockKeys) else BlockKeys(salt)
    extra = keys.extra_keys(len(tokens) // block_size)
    return tuple(chain(NO_PARENT, tokens, block_size, extra))
