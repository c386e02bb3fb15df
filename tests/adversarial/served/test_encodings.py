"""Corrupt Content-Encoding bodies against the served proxy (uvloop, C parser): 400 OpenAI
JSON, never 500, nothing in the log but one line each; good ones decoded once and served."""

from __future__ import annotations

import pytest

from proxy.bench.hostile.kit import exchange, is_openai_error, request_bytes
from proxy.bench.hostile.served import ServedProxy, auth_header
from tests.helpers.encoding_cases import CASES


@pytest.mark.parametrize(
    ("name", "encoding", "data", "status", "code"), CASES, ids=[c[0] for c in CASES]
)
async def test_encoded_bodies_on_the_served_proxy(
    served: ServedProxy, name: str, encoding: str, data: bytes, status: int, code: str | None
) -> None:
    mark = served.mark()
    headers = {
        "Authorization": auth_header("low"),
        "Content-Type": "application/json",
        "Content-Encoding": encoding,
        "Content-Length": str(len(data)),
    }
    resp = await exchange(
        served.host, served.port, request_bytes("POST", "/v1/chat/completions", headers, data)
    )
    assert resp.status == status, (name, resp.body[:300])
    if status != 200:
        assert is_openai_error(resp), resp.body[:300]
        if code is not None:
            assert resp.error_code() == code
    assert served.tracebacks(mark) == 0, "\n".join(served.lines_since(mark))
    assert served.count(r"unhandled", mark) == 0, "\n".join(served.lines_since(mark))
