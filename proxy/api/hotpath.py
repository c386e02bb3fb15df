"""Small things every request does, made cheap: its id and its metric children.

``new_request_id``: 32 hex digits like ``uuid4().hex``, from a random per-process prefix and a
counter (a fraction of a µs instead of ``os.urandom`` and a UUID object each; the ticket's nonce,
not the id, is what must be unguessable). ``LabelCache``: prometheus_client's ``labels()``
builds a key and takes a lock on every call (µs); a child once made is the same object until
the metric is removed, which the proxy never does.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any, Protocol, TypeVar

_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count(secrets.randbits(48))


def new_request_id() -> str:
    return f"{_PREFIX}{next(_COUNTER) & 0xFFFFFFFFFFFFFFFF:016x}"


Child = TypeVar("Child", covariant=True)
T = TypeVar("T")


class Labelled(Protocol[Child]):
    def labels(self, *values: Any) -> Child: ...


class LabelCache:
    """``cache(metric, *values)`` is ``metric.labels(*values)``, looked up once."""

    def __init__(self) -> None:
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Labelled[T], *values: str) -> T:
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child  # type: ignore[no-any-return]
