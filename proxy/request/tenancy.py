"""What one tenant's request may reach (docs/isolation.md): its models, no stored responses,
its own prefix-cache salt."""

from __future__ import annotations

from proxy.api.errors import bad_request, model_not_found
from proxy.api.routes import BY_ENDPOINT
from proxy.config.tenants import Tenant, Tier, allowed_models, cache_scope, model_allowed
from proxy.request.inbound import ParsedRequest
from proxy.request.route_table import ROWS
from proxy.request.stored import no_stored_responses
from proxy.scheduling.pool import BackendPool
from proxy.ticket import derive_cache_salt


def check_model(pool: BackendPool, model: str | None, tenant: Tenant, tier: Tier) -> None:
    """404 for a model no backend serves, and the very same 404 (its list of names cut to the
    key's) for one the key may not use: no oracle of what others can use."""
    patterns = allowed_models(tenant, tier)
    if patterns is not None and model is None:  # vLLM would pick its default, maybe not ours
        raise bad_request("'model' is required with this API key", param="model")
    if not pool.model_known(model) or (model and not model_allowed(patterns, model)):
        visible = (m for m in pool.known_models() if model_allowed(patterns, m))
        raise model_not_found(model, sorted(visible))


def cache_salt(secret: bytes, tenant: Tenant, tier: Tier) -> str:
    """The prefix-cache salt of the tenant's scope (its cache_group, else itself)."""
    return derive_cache_salt(secret, cache_scope(tenant, tier))


def tenant_gate(
    pool: BackendPool, secret: bytes, tier: Tier, tenant: Tenant, parsed: ParsedRequest
) -> str:
    """The checks of a parsed request that keep tenants apart (its model; no stored responses,
    proxy.request.stored), and the cache salt to send it with ("" on the routes that run no
    model)."""
    check_model(pool, parsed.model, tenant, tier)
    if ROWS[parsed.endpoint].stored_responses_refused:
        no_stored_responses(parsed.body)  # 400, or store: false
    return "" if BY_ENDPOINT[parsed.endpoint].cheap else cache_salt(secret, tenant, tier)
