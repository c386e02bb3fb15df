"""The simulator's prompts (proxy.bench.kvsim.workload): as long as the tiny model's chat
template makes them, drawn as the real client draws them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from proxy.bench.conversations import ConversationTenant, draw, words
from proxy.bench.kvsim.workload import Conversation, drawn_message, flood_prompt

TOKENIZER = Path(".tierproxy/tiny-model/tokenizer.json")


def test_a_message_is_drawn_with_the_real_clients_calls_on_the_same_stream() -> None:
    sim, client = random.Random("t/0"), random.Random("t/0")
    for span in [(3.0, 8.0), (10.0, 30.0), (81.0, 243.0)]:
        text, tokens = drawn_message(sim, span)
        n = int(draw(client, span))
        assert text == words(client, n)
        assert len(tokens) == round(4.3 * n)
    assert sim.random() == client.random()  # the next draw (max_tokens, think time) agrees


def test_a_turn_adds_the_templates_tokens_besides_its_words() -> None:
    tenant = ConversationTenant(name="t", tier="high", conversations=1, system_words=0)
    conv = Conversation(tenant, 32, random.Random(1))
    words_drawn = int(draw(random.Random(1), tenant.user_words))
    # '<|system|>\n' '</s>\n', then '<|user|>\n' WORDS '</s>\n' '<|assistant|>\n'.
    assert conv.ask().length == (11 + 2) + (8 + round(4.3 * words_drawn) + 2 + 11)
    flood = ConversationTenant(name="f", tier="low", rate_rps=1.0, prompt_words=(10, 10))
    assert flood_prompt(flood, 32, random.Random(2)).length == 8 + 43 + 2 + 11


@pytest.mark.skipif(not TOKENIZER.exists(), reason="the tiny model is not downloaded")
def test_the_templates_token_counts_are_the_tiny_models() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    assert (n("<|system|>\n"), n("<|user|>\n"), n("<|assistant|>\n"), n("</s>\n")) == (
        11,
        8,
        11,
        2,
    )
    rng = random.Random(3)
    per_word = sum(n(words(rng, 100)) for _ in range(20)) / 2000
    assert per_word == pytest.approx(4.3, abs=0.1)


def _prefixes(system_words: int, turns: int) -> list[int | None]:
    tenant = ConversationTenant(
        name="t", tier="high", conversations=1, system_words=system_words, turns=turns
    )
    conv = Conversation(tenant, 32, random.Random(4))
    out = []
    for _ in range(turns):
        out.append(conv.ask().prefix)
        conv.answer()
    return out


def test_prefix_affinity_hashes_the_messages_first_1024_characters_as_the_proxy_does() -> None:
    # A short system prompt (~120 characters): the first turns' texts are in the prefix, so
    # it changes with each turn until 1,024 characters are reached, as the real body's does.
    short = _prefixes(20, 12)
    assert len(set(short[:3])) == 3 and short[-1] == short[-2]
    # A long one (~2,400 characters) is the whole prefix: one for the conversation.
    assert len(set(_prefixes(400, 5))) == 1
