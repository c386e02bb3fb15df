"""The per-prefix token cache of rendered chat prompts (proxy.request.tokencache): a cut after
a special token gives exactly one whole encode's tokens, a conversation's next turn reuses its
earlier turns' tokens, a tokenizer where a cut would change tokens is never cut (by its
configuration, or by the verification of its first cuts), and memory stays bounded."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from proxy.request.prompt_blocks import ModelTokenizer
from proxy.request.tokencache import GIL_FREE_CHARS, VERIFY, PrefixTokenCache, encode_ids
from tests.helpers.paths import TINY_MODEL_DIR


def _tiny() -> Tokenizer:
    return ModelTokenizer(TINY_MODEL_DIR).tokenizer


def _conversation(turns: int, rng: random.Random) -> list[dict[str, str]]:
    words = ["alpha", "beta", " gamma", "δέλτα", "\n", "  ", "</", "s>", "x" * 7, "42"]
    messages = [{"role": "system", "content": "".join(rng.choices(words, k=200))}]
    for _ in range(turns):
        messages.append({"role": "user", "content": "".join(rng.choices(words, k=30))})
        messages.append({"role": "assistant", "content": "".join(rng.choices(words, k=30))})
    return messages


def test_cut_tokens_equal_a_whole_encode_and_the_next_turn_hits() -> None:
    model = ModelTokenizer(TINY_MODEL_DIR)
    assert model.template is not None and model.prefixes.enabled
    rng = random.Random(7)
    for conversation in range(4):
        history = _conversation(6, rng)
        for turn in range(1, 7):
            messages = history[: 2 * turn]  # the system prompt, then up to turn's question
            text = model.template.render(messages=messages, add_generation_prompt=True)
            whole = model.tokenizer.encode(text, add_special_tokens=False).ids
            hits = model.prefixes.hits
            assert model.prefixes.encode(text) == whole, (conversation, turn)
            if turn > 1:  # the previous turn's text up to its question is a prefix
                assert model.prefixes.hits == hits + 1
    assert model.prefixes.verify_left == 0 and model.prefixes.enabled


def test_specials_that_absorb_whitespace_are_no_cut_points() -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<e>", rstrip=True, special=True)])
    assert not PrefixTokenCache(tok).enabled
    meta = Tokenizer(models.WordLevel({"▁a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.add_special_tokens([AddedToken("<e>", special=True)])
    assert not PrefixTokenCache(meta).enabled


def test_a_cut_that_changes_tokens_turns_the_cache_off() -> None:
    meta = Tokenizer(models.WordLevel({"▁a": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.add_special_tokens([AddedToken("<e>", special=True)])
    cache = PrefixTokenCache(meta)
    cache.specials = ["<e>"]  # as if the configuration check had let it through
    first = meta.encode("a<e>a", add_special_tokens=False).ids
    assert cache.encode("a<e>a") == first  # a first sight: encoded whole, nothing cut
    assert cache.enabled and cache.verify_left == VERIFY
    longer = "a<e>a<e>a"  # from its known prefix on: "a<e>" alone would get the "▁a" token
    assert cache.encode(longer) == meta.encode(longer, add_special_tokens=False).ids
    assert not cache.enabled and cache.verify_left == VERIFY - 1


def test_memory_is_bounded_in_tokens() -> None:
    cache = PrefixTokenCache(_tiny(), max_tokens=500)
    rng = random.Random(3)
    for _ in range(50):
        text = "".join(rng.choices(["ab", "cd ", "ef"], k=100)) + "</s>tail"
        cache.encode(text)
        assert cache._held <= 500


def _ticks_during(encode: Callable[[], object]) -> int:
    """How many times this thread ran in the middle half of ``encode``, run on another thread
    (the middle half: clear of the GIL hand-overs around the encode's start and end)."""
    span: list[float] = []

    def run() -> None:
        span.append(time.perf_counter())
        encode()
        span.append(time.perf_counter())

    worker = threading.Thread(target=run)
    ticks: list[float] = []
    collecting = gc.isenabled()
    gc.disable()  # a collection here would hold the GIL itself
    try:
        worker.start()
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
    finally:
        if collecting:
            gc.enable()
    quarter = (span[1] - span[0]) / 4
    return sum(1 for t in ticks if span[0] + quarter < t < span[1] - quarter)


def test_a_long_text_is_tokenized_without_holding_the_gil() -> None:
    """Fresh eyes round six F7: one tenant's 676 KB prompts, tokenized on a worker thread, held
    the GIL for the whole Rust encode and stopped the event loop (every tenant's requests) for
    ~1 s. While a long text is encoded now, this thread runs; with the GIL held it cannot run at
    all between the encode's start and end, which the control shows."""
    tokenizer = _tiny()
    text = " ".join(f"word{i % 97} alpha beta" for i in range(12_000))  # ~200 KB
    assert len(text) >= GIL_FREE_CHARS
    assert (
        encode_ids(tokenizer, text, False) == tokenizer.encode(text, add_special_tokens=False).ids
    )
    # A held GIL gives no tick in any try. A busy machine can keep this thread off its core for
    # one whole try (CI, stop 55: a 2 s encode, no tick), so a few tries.
    assert any(_ticks_during(lambda: encode_ids(tokenizer, text, False)) for _ in range(5))
    assert _ticks_during(lambda: tokenizer.encode(text, add_special_tokens=False)) == 0


class _Counting:
    """A tokenizer that counts its encodes (everything else is the tokenizer's)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.encodes += 1
        return self.tokenizer.encode(*args, **kwargs)


def test_a_first_sight_is_encoded_once_and_its_head_kept() -> None:
    """The opening burst after a start is all first sights: each used to be encoded in two
    pieces and then whole to verify the cut (twice the work, the kv-routing benchmark's first
    high-tier turns queued 11-17 ms behind it); one whole encode is exact by definition."""
    model = ModelTokenizer(TINY_MODEL_DIR)
    assert model.template is not None
    counting = _Counting(model.tokenizer)
    cache = PrefixTokenCache(cast(Tokenizer, counting))
    history = _conversation(2, random.Random(5))
    first = model.template.render(messages=history[:2], add_generation_prompt=True)
    assert cache.encode(first) == model.tokenizer.encode(first, add_special_tokens=False).ids
    assert counting.encodes == 1 and cache.hits == 0 and cache._held > 0
    second = model.template.render(messages=history[:4], add_generation_prompt=True)
    assert cache.encode(second) == model.tokenizer.encode(second, add_special_tokens=False).ids
    assert cache.hits == 1 and cache.verify_left == VERIFY - 1
