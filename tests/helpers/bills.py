"""What the proxy bills a request that ended without the backend's usage: its prompt's upper
bound (``ParsedRequest.prompt_upper_bound``, what its quota reserved), computed here as the
proxy computes it, so that a test does not hard-code a measure another change may refine."""

from __future__ import annotations

import json
from typing import Any

from proxy.api.routes import Endpoint
from proxy.config.schema import Config
from proxy.request.inbound import parse_body


def prompt_bound(config: Config, body: dict[str, Any], endpoint: Endpoint = "chat") -> int:
    """The prompt's upper bound of ``body`` sent by a tenant of the ``normal`` tier, encoded as
    aiohttp's client encodes ``json=`` (``json.dumps``: the bound counts the body's bytes)."""
    parsed = parse_body(
        json.dumps(body).encode(),
        endpoint,
        config.tiers["normal"],
        config.limits,
        config.scheduling,
        inputs=config.input,
    )
    return parsed.prompt_upper_bound
