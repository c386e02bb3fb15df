"""The hostile mix: tenants with quotas and budgets (some run out), and each category's
requests, planned from a seed before the run."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.config.tenants import hash_key

MODEL = "tiny"
# Per million tokens: one unit per prompt token, four per output token (budgets read as tokens).
PRICE = {"input": 1_000_000, "output": 4_000_000}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up. " + "Long description. " * 40,
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}, "file": {"type": "string"}},
            },
        },
    }
]


@dataclass(frozen=True)
class TenantPlan:
    name: str
    quota: dict[str, float]

    @property
    def key(self) -> str:
        return f"key-{self.name}"

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tier": "normal",
            "keys": [{"sha256": hash_key(self.key)}],
            "quota": self.quota,
        }


def tenants(scale: float = 1.0) -> list[TenantPlan]:
    """One tenant that never runs out, one that runs out of tokens, one out of money."""
    return [
        TenantPlan("ample", {"tokens_per_day": 10**8, "budget_per_day": 10**9}),
        TenantPlan("tokens", {"tokens_per_day": int(5_000 * scale)}),
        TenantPlan("budget", {"tokens_per_day": 10**8, "budget_per_day": 8_000 * scale}),
    ]


@dataclass
class Planned:
    """One request: where it goes, its body, and how the client treats the answer."""

    category: str
    index: int
    tenant: TenantPlan
    path: str
    body: dict[str, Any]
    cut_after_events: int | None = None  # a stream the client closes after this many events
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return f"{self.category}-{self.index}"

    @property
    def choices(self) -> int:
        return int(self.body.get("n") or 1)

    def worst_tokens(self) -> int:
        """The reservation's bound as docs/quotas.md states it: every body byte a prompt token,
        32 for the template, ``max_tokens`` for each choice."""
        return len(orjson.dumps(self.body)) + 32 + self.choices * int(self.body["max_tokens"])


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(400)}" for _ in range(count))


def _chat(rng: random.Random, words: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _words(rng, words)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return {**body, **extra}


def _completion(rng: random.Random, words: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": _words(rng, words), "max_tokens": max_tokens}
    return {**body, "ignore_eos": True, **extra}


STREAM = {"stream": True, "stream_options": {"include_usage": True}}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def category_bodies(
    category: str, rng: random.Random, index: int
) -> tuple[str, dict[str, Any], int | None]:
    """(path, body, events after which the client cuts) of the index-th request of a category."""
    if category == "plain":
        return CHAT, _chat(rng, rng.randint(10, 120), rng.randint(8, 64)), None
    if category == "cut":  # a stream the client closes at a random point (or reads whole)
        cut = rng.randint(1, 160) if index % 4 else None
        return CHAT, _chat(rng, rng.randint(10, 120), 160, **STREAM), cut
    if category == "n":
        if index % 2:
            return COMPLETIONS, _completion(rng, rng.randint(10, 80), 24, n=3), None
        return CHAT, _chat(rng, rng.randint(10, 80), 24, n=2, **STREAM), None
    if category == "big":  # top-20 logprobs of every prompt and output token: near and past
        words = rng.randint(15, 90)  # the relay's max_response_bytes (run.MAX_RESPONSE_BYTES)
        extra = {"echo": True, "logprobs": 20, "prompt_logprobs": 20}
        return COMPLETIONS, _completion(rng, words, rng.randint(8, 48), **extra), None
    if category == "tools":  # vLLM refuses "auto" (400: no tool parser), runs "none"
        choice = {} if index % 3 == 0 else {"tool_choice": "none"}
        return CHAT, _chat(rng, rng.randint(10, 60), 24, tools=TOOLS, **choice), None
    if category == "nomodel":
        body = _chat(rng, rng.randint(10, 120), rng.randint(8, 64))
        del body["model"]
        return CHAT, body, None
    raise ValueError(f"unknown category {category!r}")


CATEGORIES = ("plain", "cut", "n", "big", "tools", "nomodel")


def plan(per_category: int, seed: int, scale: float = 1.0) -> dict[str, list[Planned]]:
    """Each category's requests, round-robin over the tenants, fixed by ``seed``."""
    rng = random.Random(seed)
    people = tenants(scale)
    phases: dict[str, list[Planned]] = {}
    for category in CATEGORIES:
        phases[category] = []
        for i in range(per_category):
            path, body, cut = category_bodies(category, rng, i)
            tenant = people[i % len(people)]
            phases[category].append(Planned(category, i, tenant, path, body, cut))
    return phases
