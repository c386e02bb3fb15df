"""Run the real proxy app in-process for integration tests: proxy.bench.inproc re-exported."""

from __future__ import annotations

from proxy.bench.inproc import KEYS, SECRET, auth, make_config, running_proxy, until

__all__ = ["KEYS", "SECRET", "auth", "make_config", "running_proxy", "until"]
