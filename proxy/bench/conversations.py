"""Conversation scenarios: tenants holding multi-turn chats over their own long system prompt,
each turn resending the whole conversation (so what vLLM's prefix cache holds decides how much
of each prompt is computed again), beside flood tenants of unique prompts.

Unlike the open-loop scenarios of ``proxy.bench.scenario``, a conversation is closed-loop: a turn
is sent once the previous answer came back (and a think time passed). Prompts are seeded per
tenant and conversation, so every run of a scenario sends the same texts in the same order
per conversation, whatever the proxy's policy. Shipped ones live in
``proxy/bench/scenarios/conversations/``; ``benchmarks/kv_routing.py`` runs them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proxy.bench.scenario import SCENARIO_DIR, ScenarioError

CONVERSATION_DIR = SCENARIO_DIR / "conversations"

# Words of the prompts: fixed, so that a prompt's size in tokens depends on its seed only.
_SYLLABLES = ("ka", "lo", "mi", "tu", "re", "sa", "no", "vi", "de", "po", "an", "el", "or", "us")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Range = tuple[float, float]


class ConversationTenant(_Strict):
    """A tenant of conversations (``conversations`` > 0) or a flood (``rate_rps`` > 0)."""

    name: str = Field(min_length=1)
    tier: str = Field(min_length=1)
    key: str | None = None  # API key; default bench-<name>-key
    # Tenants of one cache group share one prefix-cache salt (docs/isolation.md) and, with
    # shared_words, a preamble at the head of their system prompts (a prefix shared by tenants).
    cache_group: str | None = None
    shared_words: int = Field(0, ge=0)
    # Conversations: how many run at once, their shared system prompt, turns each.
    conversations: int = Field(0, ge=0)
    system_words: int = Field(0, ge=0)
    turns: int = Field(6, ge=1)
    user_words: Range = (10, 30)
    reply_words: Range = (10, 30)  # the assistant's turn as the client resends it
    think_s: Range = (0.2, 1.0)
    # Flood: Poisson arrivals of unique prompts.
    rate_rps: float = Field(0.0, ge=0)
    prompt_words: Range = (50, 150)
    max_tokens: Range = (16, 32)

    @model_validator(mode="after")
    def _kind(self) -> ConversationTenant:
        if (self.conversations > 0) == (self.rate_rps > 0):
            raise ValueError("give conversations (a chat tenant) or rate_rps (a flood), not both")
        for name in ("user_words", "reply_words", "think_s", "prompt_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be [low, high] with 0 <= low <= high")
        return self

    @property
    def api_key(self) -> str:
        return self.key or f"bench-{self.name}-key"

    def system_prompt(self) -> str:
        own = words(random.Random(f"{self.name}/system"), self.system_words)
        if not (self.shared_words and self.cache_group):
            return own
        shared = words(random.Random(f"group/{self.cache_group}"), self.shared_words)
        return f"{shared} {own}"


class EngineShape(_Strict):
    """The engines the scenario wants: small KV caches make the placement matter."""

    kv_blocks: int = Field(160, gt=0)  # --num-gpu-blocks-override
    block_size: int = Field(32, gt=0)
    max_num_seqs: int = Field(4, gt=0)
    max_model_len: int = Field(2048, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)  # None: vLLM's default


class ConversationScenario(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    duration_s: float = Field(90.0, gt=0)
    engine: EngineShape = EngineShape()
    max_inflight: int = Field(4, gt=0)  # per backend, in the proxy
    engines: int = Field(2, ge=1)  # how many engines benchmarks/kv_routing.py starts
    tenants: list[ConversationTenant] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> ConversationScenario:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("a tenant name appears twice")
        return self

    @property
    def tiers(self) -> list[str]:
        return list(dict.fromkeys(t.tier for t in self.tenants))


def words(rng: random.Random, n: int) -> str:
    """``n`` made-up words (two or three syllables each)."""
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(n)
    )


def draw(rng: random.Random, span: Range) -> float:
    return rng.uniform(*span)


def available_conversation_scenarios() -> list[str]:
    return sorted(p.stem for p in CONVERSATION_DIR.glob("*.yaml"))


def load_conversation_scenario(name_or_path: str) -> ConversationScenario:
    """A shipped conversation scenario by name, or a file by path; raises ScenarioError."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = CONVERSATION_DIR / f"{name_or_path}.yaml"
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        known = ", ".join(available_conversation_scenarios())
        raise ScenarioError(
            f"no conversation scenario {name_or_path!r} (shipped: {known})"
        ) from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    try:
        return ConversationScenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"scenario {name_or_path!r}: {exc}") from exc
