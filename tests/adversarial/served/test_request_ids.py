"""The proxy's request ids, as two tenants of `tierproxy serve` see them: nothing in the ids
one tenant gets tells it the next id another will get (they were a fixed prefix + a counter,
and a guessed id can be sent back as one's own ``X-Request-Id``)."""

from __future__ import annotations

import asyncio
import itertools

from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import ServedProxy, auth_header

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def ids_of(served: ServedProxy, tier: str, n: int) -> list[str]:
    req = json_request("/v1/chat/completions", BODY, None, {"Authorization": auth_header(tier)})
    out = []
    for _ in range(n):
        resp = await exchange(served.host, served.port, req)
        assert resp.status == 200, resp.body
        out.append(resp.headers["x-request-id"])
    return out


def bits_apart(a: str, b: str) -> int:
    return (int(a, 16) ^ int(b, 16)).bit_count()


async def test_one_tenant_cannot_predict_anothers_next_id(served: ServedProxy) -> None:
    mine, theirs = await asyncio.gather(ids_of(served, "low", 40), ids_of(served, "high", 40))
    ids = mine + theirs
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)
    # No shared prefix to learn, no step to add: each id is 128 fresh random bits, so two ids
    # differ in about 64 of them (a counter's neighbours differ in one or two).
    assert len({i[:8] for i in ids}) > len(ids) // 2
    for earlier in mine:
        for later in theirs:
            assert bits_apart(earlier, later) > 24
    distances = [bits_apart(a, b) for a, b in itertools.pairwise(ids)]
    assert 54 < sum(distances) / len(distances) < 74
