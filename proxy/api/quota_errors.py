"""The refusals of a tenant's quota and budget (``quota:``): 429, OpenAI's
``insufficient_quota`` type, code ``quota_exceeded`` or ``budget_exceeded``, a ``Retry-After``
to the period's reset and ``x-should-retry: false`` (the SDKs would otherwise retry at once,
twice, for nothing: nothing frees before the reset)."""

from __future__ import annotations

from proxy.api.errors import ProxyError
from proxy.api.quota_counters import COUNTERS


def quota_refused(
    counter: str, limit: float, used: float, asked: float, reset_s: float
) -> ProxyError:
    """``counter``: a name in ``COUNTERS`` (its measure, period and code say the rest)."""
    kind = COUNTERS[counter]
    money, span = kind.money, kind.period_text
    fmt = "{:.4f}" if money else "{:.0f}"
    what = "budget" if money else "token quota"
    message = (
        f"Your key's {what} for this {span} is used up ({counter}: limit {fmt.format(limit)},"
        f" used {fmt.format(used)}, this request needs up to {fmt.format(asked)}); it resets in"
        f" {reset_s:.0f}s."
    )
    if asked > limit:
        message += " This request needs more than the whole quota: lower max_tokens or n."
    return ProxyError(
        429,
        message,
        type="insufficient_quota",
        code=kind.code,
        retry_after_s=reset_s,
        retryable=False,
    )


def unpriced(model: str | None) -> ProxyError:
    """A tenant with a budget asked for work that no ``pricing:`` entry prices: refused, never
    run for free."""
    what = f"model '{model}'" if model else "the backends' default model (no 'model' was sent)"
    return ProxyError(
        400,
        f"Your key has a budget and {what} has no price on this service; name a priced model"
        " or ask the operator to price it.",
        type="invalid_request_error",
        param="model",
        code="model_not_priced",
    )
