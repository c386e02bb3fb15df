"""What one tenant's request may reach (docs/isolation.md): its models, no stored responses,
its own prefix-cache salt."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.api.errors import bad_request, model_not_found
from proxy.api.routes import BY_ENDPOINT
from proxy.backends.pool import BackendPool
from proxy.config.adapters import Adapter, model_visible
from proxy.config.schema import Config
from proxy.config.tenants import Tenant, Tier, allowed_models, cache_scope
from proxy.request.admitted import Admitted
from proxy.request.inbound import ParsedRequest
from proxy.request.route_table import ROWS
from proxy.request.stored import no_stored_responses
from proxy.ticket import derive_cache_salt


def check_model(
    pool: BackendPool,
    model: str | None,
    tenant: Tenant,
    tier: Tier,
    adapters: Mapping[str, Adapter] | None = None,
) -> None:
    """404 for a model no backend serves, and the very same 404 (its list of names cut to the
    key's) for one the key may not use, a private adapter of another tenant's included: no
    oracle of what others can use."""
    patterns = allowed_models(tenant, tier)
    adapters = adapters or {}
    if patterns is not None and model is None:  # vLLM would pick its default, maybe not ours
        raise bad_request("'model' is required with this API key", param="model")
    adapter = model is not None and model in adapters
    known = pool.serves_adapter(model) if model is not None and adapter else pool.model_known(model)
    strays = pool.engine_adapters()  # served by an engine, not in the catalogue: nobody's
    if not known or (model and not model_visible(model, patterns, adapters, tenant, strays)):
        # Adapters only where a request for one would be served (its base model on a backend
        # that runs adapters), as /v1/models lists them.
        names = pool.known_models() | {a for a in adapters if pool.serves_adapter(a)}
        visible = (m for m in names if model_visible(m, patterns, adapters, tenant, strays))
        raise model_not_found(model, sorted(visible))


def cache_salt(secret: bytes, tenant: Tenant, tier: Tier) -> str:
    """The prefix-cache salt of the tenant's scope (its cache_group, else itself)."""
    return derive_cache_salt(secret, cache_scope(tenant, tier))


def tenant_gate(
    pool: BackendPool, secret: bytes, config: Config, tenant: Tenant, parsed: ParsedRequest
) -> str:
    """The checks of a parsed request that keep tenants apart (its model; no stored responses,
    proxy.request.stored), and the cache salt to send it with ("" on the routes that run no
    model)."""
    tier = config.tiers[tenant.tier]
    check_model(pool, parsed.model, tenant, tier, config.adapters)
    adapter = None if parsed.model is None else config.adapters.get(parsed.model)
    if adapter is not None and BY_ENDPOINT[parsed.endpoint].cheap:
        # The tokenizer's routes load nothing (no queue, no slot): an adapter would answer
        # only while some engine holds it, which would tell any tenant what others have loaded.
        raise bad_request(
            f"The tokenizer routes take the base model `{adapter.base_model}`, not an adapter:"
            " tokenize with it (an adapter shares its base model's tokenizer unless it ships"
            " its own).",
            param="model",
        )
    if ROWS[parsed.endpoint].stored_responses_refused:
        no_stored_responses(parsed.body)  # 400, or store: false
    return "" if BY_ENDPOINT[parsed.endpoint].cheap else cache_salt(secret, tenant, tier)


def still_may_use(pool: BackendPool, current: Config, adm: Admitted) -> None:
    """Check the request's model again when it enters the queue, against the configuration in
    force now when a reload came since it was admitted: a request that waited for its tenant's
    limit, or goes round again after a failure, is refused 404 for an adapter the reload took
    from its tenant or removed, as a new request would be, rather than served (red team R1:
    served and billed, a removed adapter sent as a base model under its name)."""
    if current is adm.config or adm.parsed.model is None:
        return
    tenant = next((t for t in current.tenants if t.name == adm.tenant.name), adm.tenant)
    tier = current.tiers.get(tenant.tier) or adm.config.tiers[adm.tenant.tier]
    check_model(pool, adm.parsed.model, tenant, tier, current.adapters)
