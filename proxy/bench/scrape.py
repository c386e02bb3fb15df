"""Read gauges out of Prometheus text: the proxy's queue depth, vLLM's running and waiting."""

from __future__ import annotations

import re

import aiohttp

PROXY_QUEUE_DEPTH = "tierproxy_queue_depth"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name``: (labels, value). Unparseable lines are skipped."""
    out: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group("name") != name:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.append((labels, value))
    return out


def gauge_by(text: str, name: str, label: str) -> dict[str, float]:
    """Metric ``name`` summed per value of ``label`` (``""`` when the label is absent)."""
    out: dict[str, float] = {}
    for labels, value in parse_samples(text, name):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


async def fetch_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 2.0
) -> str | None:
    """The /metrics text, or None when it is missing or slow."""
    try:
        async with session.get(
            f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
