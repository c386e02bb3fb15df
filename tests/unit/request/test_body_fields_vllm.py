"""Every field of vLLM 0.32's own request models is known to the route it belongs to
(proxy.request.body_fields): deny by default must never refuse what vLLM accepts. Read from the
installed vLLM (skipped under the light install, run by `make test`)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from proxy.api.routes import Endpoint
from proxy.request.route_table import ROWS

pytest.importorskip("vllm")

# vLLM 0.32's request models of each route (module, class).
MODELS: dict[Endpoint, list[tuple[str, str]]] = {
    "chat": [("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest")],
    "completions": [("vllm.entrypoints.openai.completion.protocol", "CompletionRequest")],
    "responses": [("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest")],
    "embeddings": [
        ("vllm.entrypoints.pooling.embed.protocol", "EmbeddingChatRequest"),
        ("vllm.entrypoints.pooling.embed.protocol", "EmbeddingCompletionRequest"),
    ],
    "pooling": [
        ("vllm.entrypoints.pooling.pooling.protocol", "PoolingChatRequest"),
        ("vllm.entrypoints.pooling.pooling.protocol", "PoolingCompletionRequest"),
        ("vllm.entrypoints.pooling.pooling.protocol", "IOProcessorRequest"),
    ],
    "classify": [
        ("vllm.entrypoints.pooling.classify.protocol", "ClassificationChatRequest"),
        ("vllm.entrypoints.pooling.classify.protocol", "ClassificationCompletionRequest"),
    ],
    "score": [
        ("vllm.entrypoints.pooling.scoring.protocol", name)
        for name in (
            "ScoreDataRequest",
            "ScoreQueriesDocumentsRequest",
            "ScoreQueriesItemsRequest",
            "ScoreTextRequest",
        )
    ],
    "rerank": [("vllm.entrypoints.pooling.scoring.protocol", "RerankRequest")],
    "tokenize": [
        ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeChatRequest"),
        ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeCompletionRequest"),
    ],
    "detokenize": [("vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest")],
}


def _model(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.fail(f"vLLM's {name} is not at {module}: update MODELS to the installed vLLM")


@pytest.mark.parametrize("endpoint", sorted(MODELS))
def test_every_field_vllm_knows_is_known_to_the_route(endpoint: Endpoint) -> None:
    fields = {f for module, name in MODELS[endpoint] for f in _model(module, name).model_fields}
    assert fields - ROWS[endpoint].fields.known == set()


def test_every_route_is_checked() -> None:
    assert set(MODELS) == set(ROWS)
