"""A conversation scenario's prompts as token ids, for the simulator: what vLLM would see and
what the proxy would hash (``proxy.policies.blockhash``), without a tokenizer.

A message is its role's header, its words' tokens (``TOKENS_PER_WORD`` each: the tiny model's
tokenizer on ``conversations.words``, measured) and an end; a prompt ends with the assistant's
header (the generation prompt), which the assistant's turn then begins with, so a
conversation's prompts only grow at the end, as a chat template renders them. A message's
length is drawn as the real client (``proxy.bench.convclient``) draws it, with the same calls
on the same seeded stream: a simulated conversation sends the real one's lengths, max_tokens
and think times, and its floods the real flood's (``drawn_message``). ``prefix_affinity``'s
prefix is hashed from the messages' texts as the proxy hashes the real body (its first 1,024
characters: past a short system prompt, into the first turns). The headers and
the end are as long as the tiny model's template (``<|role|>\n`` CONTENT ``</s>\n``) is in its
tokenizer, which spells the headers out character by character: a turn adds some 20 tokens
besides its words (4 when each counted as one token). Tokens are seeded per tenant,
conversation slot and group as the real client's texts are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache

from proxy.bench.conversations import ConversationTenant, Range, draw, words
from proxy.policies.blockhash import NO_PARENT, chain
from proxy.policies.prefix import prefix_hash

TOKENS_PER_WORD = 4.3
VOCAB = 1000  # ids of words' tokens; the template's own are above
# The template's own tokens (ids above the words'): '<|system|>\n' is 11 tokens, '<|user|>\n'
# 8, '<|assistant|>\n' 11, '</s>\n' 2 (the tiny model's tokenizer, measured).
SYSTEM = list(range(1100, 1111))
USER = list(range(1200, 1208))
ASSISTANT = list(range(1300, 1311))
END = [1400, 1401]
PREFIX_TOKENS = 256  # policies.prefix_affinity.prefix_tokens' default
CHARS_PER_TOKEN = 4.0


def word_tokens(rng: random.Random, n_words: float) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(round(n_words * TOKENS_PER_WORD))]


def drawn_message(rng: random.Random, span: Range) -> tuple[str, list[int]]:
    """A message of ``span`` words as the real client draws it (``words(rng, int(draw(rng,
    span)))``: the stream advances as the client's does): its text and its text's token ids."""
    n = int(draw(rng, span))
    text = words(rng, n)
    return text, word_tokens(random.Random(text), n)


@cache
def _system_text(tenant: ConversationTenant) -> str:
    return tenant.system_prompt()


def salt_of(tenant: ConversationTenant) -> str:
    """The tenant's cache scope, as the proxy derives its salt (its group, else itself)."""
    return f"group:{tenant.cache_group}" if tenant.cache_group else f"tenant:{tenant.name}"


def system_tokens(tenant: ConversationTenant) -> list[int]:
    shared: list[int] = []
    if tenant.shared_words and tenant.cache_group:
        shared = word_tokens(random.Random(f"group/{tenant.cache_group}"), tenant.shared_words)
    own = word_tokens(random.Random(f"{tenant.name}/system"), tenant.system_words)
    return [*SYSTEM, *shared, *own, *END]


@dataclass(frozen=True)
class Prompt:
    length: int
    hashes: tuple[int, ...]  # every full block's chained hash (vLLM's view)
    blocks: tuple[int, ...]  # the full blocks of all but the last token (the proxy's view)
    prefix: int | None  # prefix_affinity's hash


@dataclass
class TokenLog:
    """A growing token sequence and the chained hashes of its full blocks."""

    salt: str
    block_size: int
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)  # the chat body's

    def say(self, role: str, text: str, tokens: list[int]) -> None:
        self.messages.append({"role": role, "content": text})
        self.extend(tokens)

    def extend(self, more: list[int]) -> None:
        self.tokens += more
        done = len(self.hashes) * self.block_size
        tail = self.tokens[done : len(self.tokens) // self.block_size * self.block_size]
        if not tail:
            return
        parent = self.hashes[-1] if self.hashes else NO_PARENT
        extra = None if self.hashes else [(self.salt,)]
        self.hashes += chain(parent, tail, self.block_size, extra)

    def prompt(self) -> Prompt:
        n = len(self.tokens)
        return Prompt(
            length=n,
            hashes=tuple(self.hashes),
            blocks=tuple(self.hashes[: (n - 1) // self.block_size]),
            prefix=prefix_hash(
                {"messages": self.messages},
                tokens=PREFIX_TOKENS,
                chars_per_token=CHARS_PER_TOKEN,
                salt=self.salt,
            ),
        )


class Conversation:
    """One conversation: its system prompt, then user turns and the assistant's replies."""

    def __init__(self, tenant: ConversationTenant, block_size: int, rng: random.Random) -> None:
        self.tenant = tenant
        self.rng = rng
        self.log = TokenLog(salt_of(tenant), block_size)
        self.log.say("system", _system_text(tenant), system_tokens(tenant))

    def ask(self) -> Prompt:
        text, user = drawn_message(self.rng, self.tenant.user_words)
        self.log.say("user", text, [*USER, *user, *END, *ASSISTANT])
        return self.log.prompt()

    def answer(self) -> None:
        text, reply = drawn_message(self.rng, self.tenant.reply_words)
        self.log.say("assistant", text, [*reply, *END])


def flood_prompt(tenant: ConversationTenant, block_size: int, rng: random.Random) -> Prompt:
    log = TokenLog(salt_of(tenant), block_size)
    text, tokens = drawn_message(rng, tenant.prompt_words)
    log.say("user", text, [*USER, *tokens, *END, *ASSISTANT])
    return log.prompt()
