"""KV events of a LoRA adapter's blocks are indexed under the adapter's name and the salt, as
the proxy hashes an adapter request's prompt (``BlockKeys``): vLLM's extra keys are
``[adapter, salt]`` on the first block, then ``[adapter]``."""

from __future__ import annotations

from proxy.backends.kvevents import EventFeed, decode_batch
from proxy.policies.blockhash import BlockKeys, chain_hashes
from tests.helpers.clock import FakeClock
from tests.unit.backends.test_kvindex import B, batch, index, stored, tokens


def _feed_with_adapter_blocks() -> EventFeed:
    clock = FakeClock()
    feed = EventFeed(index(clock), clock)
    extra = [["lora-a", "salt-1"], ["lora-a"], ["lora-a"]]
    event = stored([1, 2, 3], None, tokens(12), extra, lora_name="lora-a", lora_id=7)
    feed.apply(0, decode_batch(batch(event)))
    return feed


def test_adapter_blocks_are_found_by_the_adapter_and_salt_chain() -> None:
    feed = _feed_with_adapter_blocks()
    assert len(feed.index) == 3
    assert feed.index.leading(chain_hashes(tokens(12), B, BlockKeys("salt-1", "lora-a"))) == 3


def test_other_adapter_other_salt_or_the_base_model_miss() -> None:
    idx = _feed_with_adapter_blocks().index
    assert idx.leading(chain_hashes(tokens(12), B, BlockKeys("salt-1", "lora-b"))) == 0
    assert idx.leading(chain_hashes(tokens(12), B, BlockKeys("salt-2", "lora-a"))) == 0
    assert idx.leading(chain_hashes(tokens(12), B, "salt-1")) == 0
    assert idx.leading(chain_hashes(tokens(12), B, BlockKeys("", "lora-a"))) == 0


def test_block_keys_without_an_adapter_are_the_salt_alone() -> None:
    assert chain_hashes(tokens(8), B, BlockKeys("s")) == chain_hashes(tokens(8), B, "s")
    assert BlockKeys("s", "a").extra_keys(3) == [("a", "s"), ("a",), ("a",)]
