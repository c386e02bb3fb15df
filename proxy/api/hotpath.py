"""Small things every request does, made cheap: its id and its metric children.

``new_request_id``: 32 random hex digits (128 bits) like ``uuid4().hex``, cut from one
``os.urandom`` read per 256 ids (cheaper than a read each, or a UUID object). Unguessable: a
tenant who sees its own ids learns nothing of the next one another tenant gets (they were a
prefix + counter, and a guessed id could be sent as one's own ``X-Request-Id``).

``LabelCache``: prometheus_client's ``labels()`` builds a key and takes a lock on every call
(µs); a child once made is the same object until the metric is removed, which the proxy never
does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

_BATCH = 256  # ids per urandom read (4 KiB)
_ids: Iterator[str] = iter(())


def _refill() -> None:
    global _ids
    data = os.urandom(16 * _BATCH).hex()
    _ids = iter([data[i : i + 32] for i in range(0, 32 * _BATCH, 32)])


def _forget() -> None:
    global _ids
    _ids = iter(())  # a forked child must not hand out its parent's next ids


os.register_at_fork(after_in_child=_forget)


def new_request_id() -> str:
    # A list iterator's next is atomic under the GIL: two threads never get the same id.
    for request_id in _ids:
        return request_id
    _refill()
    return next(_ids)


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
        return child
