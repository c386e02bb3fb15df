"""The OpenAI SDK's embeddings through the proxy and directly against the same pooling vLLM
(the tiny model served by vLLM's pooling runner)."""

from __future__ import annotations

import asyncio
import math

import pytest

from proxy.tools.engine import EngineProcess
from tests.helpers.compat import MODEL, Sides, dump, shape
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import EMBED

# long: a pooling engine of its own (a start of ~30 s for two tests).
pytestmark = [pytest.mark.integration, pytest.mark.engines(EMBED), pytest.mark.long]
INPUTS = ["hello there", "a second, longer sentence to embed"]


@pytest.fixture
def compat_engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(EMBED)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b, strict=True)
    )


async def test_embeddings_sync_default_encoding_same_vectors(both: Sides) -> None:
    answers = {
        side: dump(await asyncio.to_thread(client.embeddings.create, model=MODEL, input=INPUTS))
        for side, client in both.sync_clients().items()
    }
    proxy, direct = answers["proxy"], answers["direct"]
    assert shape(proxy) == shape(direct)
    assert proxy["usage"] == direct["usage"] and proxy["model"] == direct["model"]
    assert [d["index"] for d in proxy["data"]] == [0, 1]
    for mine, theirs in zip(proxy["data"], direct["data"], strict=True):
        assert _close(mine["embedding"], theirs["embedding"])


async def test_embeddings_async_float_same_vectors(both: Sides) -> None:
    answers = {
        side: dump(
            await client.embeddings.create(model=MODEL, input=INPUTS[0], encoding_format="float")
        )
        for side, client in both.async_clients().items()
    }
    proxy, direct = answers["proxy"], answers["direct"]
    assert shape(proxy) == shape(direct) and proxy["usage"] == direct["usage"]
    assert _close(proxy["data"][0]["embedding"], direct["data"][0]["embedding"])
