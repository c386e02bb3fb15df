"""The family of conversation workloads (``proxy/bench/scenarios/families/kv-family.yaml``):
every shape a ``ConversationScenario`` drawn from the file's ranges by its own seed, so that the
simulator (``benchmarks/kv_sim.py``) and real engines (``benchmarks/kv_routing.py --shape NAME``)
run the same shape. A shape's name says its seed and what it is made of."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from proxy.bench.conversations import ConversationScenario, ConversationTenant, EngineShape
from proxy.bench.kvsim.workload import TOKENS_PER_WORD
from proxy.bench.scenario import SCENARIO_DIR, ScenarioError

FAMILY_FILE = SCENARIO_DIR / "families" / "kv-family.yaml"
FLOOD_CAP_TOKENS_S = 10_000


@dataclass(frozen=True)
class Shape:
    name: str
    seed: int
    scenario: ConversationScenario
    working_set_blocks: int  # every tenant's system prompt and every conversation at its longest
    cache_ratio: float  # all engines' KV blocks over the working set
    flood_share: float


def load_family(path: Path = FAMILY_FILE, seed: int | None = None) -> list[Shape]:
    spec: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    first = spec["seed"] if seed is None else seed
    return [draw_shape(spec, first * 1000 + i) for i in range(spec["shapes"])]


def find_shape(name: str, path: Path = FAMILY_FILE) -> Shape:
    """A shape by name (``s32007-...`` or just ``s32007``), or any seed as ``sSEED``."""
    seed_part = name.split("-", 1)[0]
    if not (seed_part.startswith("s") and seed_part[1:].isdigit()):
        raise ScenarioError(f"no shape {name!r}: shapes are named sSEED-...")
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    return draw_shape(spec, int(seed_part[1:]))


def _words(tokens: float) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_shape(spec: dict[str, Any], seed: int) -> Shape:
    rng = random.Random(seed)
    bs = spec["block_size"]
    engines = rng.randint(*spec["engines"])
    n_tenants = round(_log_uniform(rng, *spec["tenants"]))
    system = round(_log_uniform(rng, *spec["system_tokens"]))
    shared = 0
    group_size = 1
    if rng.random() < spec["shared_prefix_share"]:
        shared = round(_log_uniform(rng, *spec["shared_tokens"]))
        group_size = rng.randint(*spec["group_size"])
    convs = rng.randint(*spec["conversations"])
    user = round(_log_uniform(rng, *spec["user_tokens"]))
    turn_tokens = 2 * user + 6  # a user's turn and a reply, each within [user/2, 3/2 user]
    turns = rng.randint(*spec["turns"])
    room = spec["max_prompt_tokens"] - system - shared
    turns = max(1, min(turns, int(room / (1.5 * turn_tokens))))
    think = tuple(rng.choice(spec["think_s"]))
    flood_share = rng.uniform(*spec["flood_share"]) if rng.random() < 0.8 else 0.0
    mix: dict[str, float] = rng.choice(spec["tier_mixes"])
    seqs = rng.randint(*spec["max_num_seqs"])
    max_tokens = tuple(rng.choice(spec["max_tokens"]))
    ratio = _log_uniform(rng, *spec["cache_ratio"])
    tiers = _tiers(mix, n_tenants)
    tenants = []
    for i, tier in enumerate(tiers):
        group = f"g{i // group_size}" if shared else None
        tenants.append(
            ConversationTenant(
                name=f"t{i:02d}",
                tier=tier,
                conversations=convs,
                system_words=_words(system),
                turns=turns,
                user_words=(_words(user / 2), _words(1.5 * user)),
                reply_words=(_words(user / 2), _words(1.5 * user)),
                think_s=think,
                max_tokens=max_tokens,
                cache_group=group,
                shared_words=_words(shared) if shared else 0,
            )
        )
    # The working set: system prompts (a group's preamble once) and each conversation whole.
    sys_blocks = n_tenants * system / bs + (math.ceil(n_tenants / group_size) * shared / bs)
    conv_blocks = n_tenants * convs * turns * turn_tokens / bs
    working = max(1, round(sys_blocks + conv_blocks))
    longest = (system + shared + turns * 1.5 * turn_tokens + max_tokens[1]) / bs
    flood_tokens = 0
    if flood_share > 0:
        lo_f, hi_f = spec["flood_tokens"]
        flood_tokens = round(_log_uniform(rng, lo_f, hi_f))
        longest = max(longest, (1.5 * flood_tokens + max_tokens[1]) / bs)
    # Every prompt fits an engine's cache, with a block for each other request it runs.
    per_engine = max(round(ratio * working / engines), math.ceil(longest) + 2 * seqs)
    if flood_share > 0:
        # Conversation turns per second, roughly: each slot one turn per think time and ~0.2 s.
        turn_rps = n_tenants * convs / (sum(think) / 2 + 0.2)
        # At most the engines' prefill capacity (EngineCosts: ~10k tokens/s each) by itself.
        turn_rps = min(turn_rps, FLOOD_CAP_TOKENS_S * engines / flood_tokens)
        tenants.append(
            ConversationTenant(
                name="flood",
                tier="low",
                rate_rps=round(turn_rps * flood_share / (1 - flood_share), 3) or 0.01,
                prompt_words=(_words(flood_tokens / 2), _words(1.5 * flood_tokens)),
                max_tokens=max_tokens,
            )
        )
    name = (
        f"s{seed}-e{engines}-t{n_tenants}-sys{system}"
        + (f"-sh{shared}x{group_size}" if shared else "")
        + f"-c{convs}x{turns}-f{round(100 * flood_share)}-r{ratio:.2f}"
    )
    scenario = ConversationScenario(
        name=name,
        description=f"kv family shape, seed {seed}",
        duration_s=spec["duration_s"],
        engine=EngineShape(
            kv_blocks=per_engine,
            block_size=bs,
            max_num_seqs=seqs,
            # vLLM refuses to start when one sequence of max_model_len would not fit its cache
            # (less the null block it keeps).
            max_model_len=min(spec["max_model_len"], (per_engine - 1) * bs),
            max_num_batched_tokens=spec["max_num_batched_tokens"],
        ),
        max_inflight=seqs,
        engines=engines,
        tenants=tenants,
    )
    return Shape(name, seed, scenario, working, per_engine * engines / working, flood_share)


def _tiers(mix: dict[str, float], n: int) -> list[str]:
    """``n`` tenants' tiers in the mix's proportions (at least one of the first tier)."""
    out: list[str] = []
    for tier, share in mix.items():
        out += [tier] * round(share * n)
    out = (out or [next(iter(mix))])[:n]
    while len(out) < n:
        out.append(next(reversed(mix)))
    return out
