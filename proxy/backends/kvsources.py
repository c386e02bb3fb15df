"""Where a backend's KV events come from, as its ``GET /kv_event_sources`` says (vLLM's
publisher config: ``{rank: config}``).

The answer comes from the backend, so it may only name the backend's own host: a ``tcp://``
endpoint whose host is the backend URL's, or a wildcard (``tcp://*:5557``, what vLLM binds),
which stands for it. Anything else (another host, ``ipc://`` or ``inproc://`` on the proxy's
own host) is refused: else a backend could point the proxy's connections at any address, or
feed its index from another backend's publisher. Such endpoints go in the config instead
(``backends[].kv_events``), where the operator names them.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def _host_of(backend_url: str) -> str:
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def with_host(endpoint: object, backend_url: str, refused: list[str]) -> str | None:
    """A ``tcp://`` endpoint on the backend's host (a wildcard host replaced by it); None for
    anything else (what was refused appended to ``refused``)."""
    if not isinstance(endpoint, str) or not endpoint:
        return None
    backend_host = _host_of(backend_url)
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        refused.append(endpoint[:200])
        return None
    if host in _WILDCARD_HOSTS:
        host = backend_host
    elif host.lower() != backend_host.lower():
        refused.append(endpoint[:200])
        return None
    return f"tcp://{host}:{port}"


def event_endpoints(
    sources: object, backend_url: str, refused: list[str] | None = None
) -> tuple[str, str | None] | None:
    """(the publisher's endpoint, its replay endpoint or None) from vLLM's
    ``/kv_event_sources`` answer, wildcard hosts replaced by the backend's; None: no ZMQ
    publisher, one not on the backend's host (in ``refused``), or more than one data-parallel
    rank (each its own cache: not indexed)."""
    out = refused if refused is not None else []
    if not isinstance(sources, dict) or len(sources) != 1:
        return None
    (config,) = sources.values()
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
        return None
    if config.get("publisher") != "zmq":
        return None
    endpoint = with_host(config.get("endpoint"), backend_url, out)
    if endpoint is None:
        return None
    steps = config.get("buffer_steps")
    if isinstance(steps, int) and steps < 1:
        return endpoint, None  # a replay that keeps nothing: its empty answer tells nothing
    return endpoint, with_host(config.get("replay_endpoint"), backend_url, out)


def event_endpoint(sources: object, backend_url: str) -> str | None:
    found = event_endpoints(sources, backend_url)
    return found[0] if found is not None else None


class SourcesWarnings:
    """What one backend's ``/kv_event_sources`` answers refused or lacked, each warned once
    (16 refused endpoints at most: the answer is the backend's to choose)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._missing_warned = False
        self._refused_warned: set[str] = set()

    def refused(self, label: str, endpoints: list[str]) -> None:
        for endpoint in endpoints:
            if endpoint not in self._refused_warned and len(self._refused_warned) < 16:
                self._refused_warned.add(endpoint)
                self._log.warning(
                    "backend %s: its /kv_event_sources names %r, not a tcp:// endpoint on its"
                    " own host: refused (name it in the backend's config, kv_events, to use it)",
                    label,
                    endpoint,
                )

    def missing(self, label: str) -> None:
        if not self._missing_warned:
            self._missing_warned = True
            self._log.warning(
                "backend %s: no ZMQ KV-event publisher of a single data-parallel rank in its"
                " /kv_event_sources: its prefix cache is not indexed (docs/kv-cache.md)",
                label,
            )
