"""A hand-written config file for the `tierproxy keys` tests (comments and layout to keep) and
the fixed clock they edit it at."""

from __future__ import annotations

from datetime import UTC, datetime

NOW = datetime(2026, 3, 1, 9, 30, 15, 250_000, tzinfo=UTC)
A, B = "a" * 64, "b" * 64

BLOCK = f"""# hand-written: every comment here must survive
listen: {{host: 127.0.0.1, port: 8000}}
tiers:
  high: {{priority: 0, weight: 10, max_queue: 10, queue_timeout_s: 5, request_timeout_s: 60}}

tenants:
  # the chat front end
  - name: chat
    tier: high
    keys:
      - sha256: "{A}"   # laptop key, quoted
        id: aaaaaaaaaaaa
      # the CI runner's key
      - sha256: {B}
    weight: 2
  - name: batch
    tier: high
    keys:
    - {{sha256: "{"c" * 64}"}}

backends:
  - url: http://127.0.0.1:8100   # the one engine
"""


def now() -> datetime:
    return NOW
