"""Which requests the middleware handles: deny by default.

Every request with a method that may change state (anything but GET, HEAD, OPTIONS) is
ticketed, whatever its path, so a route a future vLLM adds is covered without a change here.
Generation routes the proxy uses also get the ticket's scheduler hints and output budget.
"""

from __future__ import annotations

import enum

SAFE_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "OPTIONS"})

# The routes the proxy sends: full ticket handling (priority, xargs, budget).
GENERATION_PATHS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
)

# POST routes that provably run no model work and may pass without a ticket: SageMaker's POST
# health probe (answers from the engine's health state). Nothing else: /tokenize and the render
# routes cost CPU, the dev/RL routes pause, sleep or reload the engine.
UNTICKETED_POST_PATHS: frozenset[str] = frozenset({"/ping"})


class Rule(enum.Enum):
    PASS = "pass"  # untouched: no model work
    TICKETED = "ticketed"  # ticket required (if configured), priority forced, xargs cleaned
    GENERATION = "generation"  # TICKETED plus the ticket's xargs and budget


def rule_for(method: str, path: str) -> Rule:
    if method.upper() in SAFE_METHODS:
        return Rule.PASS
    if method.upper() == "POST" and path in UNTICKETED_POST_PATHS:
        return Rule.PASS
    if method.upper() == "POST" and path in GENERATION_PATHS:
        return Rule.GENERATION
    return Rule.TICKETED
