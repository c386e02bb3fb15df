"""The vLLM routes the proxy serves, as vLLM 0.32 names them (vllm/entrypoints/*/api_router.py).

Every route that runs the model goes through the tiers (queue, tenant limits, signed ticket,
accounting); the request is sent on to the same path on the backend. ``cheap`` routes (the
tokenizer's) run no model: they skip the queue, never authentication or the ticket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal[
    "chat",
    "completions",
    "responses",
    "embeddings",
    "pooling",
    "classify",
    "score",
    "rerank",
    "tokenize",
    "detokenize",
]


@dataclass(frozen=True)
class Route:
    endpoint: Endpoint
    paths: tuple[str, ...]  # what clients call; each is sent on unchanged
    generates: bool = False  # produces tokens: output budget, tier clamp, streams
    cheap: bool = False  # no model work: bypasses the queue


ROUTES: tuple[Route, ...] = (
    Route("chat", ("/v1/chat/completions",), generates=True),
    Route("completions", ("/v1/completions",), generates=True),
    Route("responses", ("/v1/responses",), generates=True),
    Route("embeddings", ("/v1/embeddings",)),
    Route("pooling", ("/pooling",)),
    Route("classify", ("/classify",)),
    Route("score", ("/score", "/v1/score")),
    Route("rerank", ("/rerank", "/v1/rerank", "/v2/rerank")),
    Route("tokenize", ("/tokenize",), cheap=True),
    Route("detokenize", ("/detokenize",), cheap=True),
)

BY_ENDPOINT: dict[Endpoint, Route] = {route.endpoint: route for route in ROUTES}
POST_PATHS: tuple[str, ...] = tuple(path for route in ROUTES for path in route.paths)


def served_paths_text() -> str:
    """For the answer to an unknown URL."""
    return ", ".join([*POST_PATHS, "/v1/models", "/health", "/version"])
