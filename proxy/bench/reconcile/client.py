"""One planned request sent through the proxy: read whole, or a stream the client closes after
a number of events (the connection dropped, as a client that leaves does)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from proxy.bench.reconcile.mix import Planned

TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10)


@dataclass(frozen=True)
class Sent:
    planned: Planned
    status: int
    body_bytes: int
    events: int  # SSE data events read (streams)
    cut: bool  # the client closed it before its end


async def send(session: aiohttp.ClientSession, base: str, planned: Planned) -> Sent:
    headers = {
        "Authorization": f"Bearer {planned.tenant.key}",
        "X-Request-Id": planned.request_id,
    }
    url = f"{base}{planned.path}"
    async with session.post(url, json=planned.body, headers=headers, timeout=TIMEOUT) as resp:
        if planned.cut_after_events is None or resp.status != 200:
            body = await resp.read()
            return Sent(planned, resp.status, len(body), body.count(b"data: "), False)
        events = size = 0
        async for line in resp.content:
            size += len(line)
            if line.startswith(b"data: "):
                events += 1
                if events >= planned.cut_after_events:
                    resp.close()  # drops the connection: the proxy sees its client gone
                    return Sent(planned, resp.status, size, events, True)
        return Sent(planned, resp.status, size, events, False)
