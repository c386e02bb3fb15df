"""What the tier scheduler reads of a vLLM request: the ticket's ``vllm_xargs`` (time limit,
prefill share), its place in vLLM's own order, and the prompt tokens it has left to prefill."""

from __future__ import annotations

import math
from typing import Any

from vllm.v1.request import Request, RequestStatus

from proxy.ticket import XARG_PREFILL_SHARE, XARG_TIME_LIMIT

# Statuses of a waiting request that the scheduling loop would try to admit now.
ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _extra_args(request: Request) -> dict[str, Any]:
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    return extra if isinstance(extra, dict) else {}


def request_time_limit(request: Request) -> float | None:
    """The ticket's time limit (seconds, from receipt) the middleware put into ``vllm_xargs``."""
    value = _extra_args(request).get(XARG_TIME_LIMIT)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return max(0.0, float(value))
    return None


def request_prefill_share(request: Request, default: float) -> float:
    value = _extra_args(request).get(XARG_PREFILL_SHARE)
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    return default


def rank(request: Request) -> tuple[int, float]:
    """vLLM's own order: lower priority value first, then earlier arrival."""
    return (request.priority, request.arrival_time)


def prefill_left(request: Request) -> int:
    return max(0, request.num_tokens - request.num_computed_tokens)
