"""`adapters:`: the LoRA adapters tenants bring (docs/adapters.md): where engines load each
from, its base model, who may use it and its price."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Collection, Mapping

from pydantic import Field

from proxy.config.base import Strict
from proxy.config.quotas import Price, price_of
from proxy.config.tenants import Tenant

# The shape of a tenant's cache salt (proxy.ticket.derive_cache_salt: 43 base64url characters).
# vLLM folds the adapter's name and the salt into one list of extra keys: a name of this shape
# could stand for a salt, so none is allowed.
_SALT_SHAPE = re.compile(r"^[A-Za-z0-9_-]{43}$")
# What vLLM's /v1/load_lora_adapter and a URL path take without surprises.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class Adapter(Strict):
    """One LoRA adapter of a base model."""

    path: str = Field(
        min_length=1,
        pattern=r"\S",
        description="Where the engines load it from (their file system's path, or what their"
        " LoRA resolver takes), as `--lora-modules NAME=PATH` or `POST /v1/load_lora_adapter`.",
    )
    base_model: str = Field(
        min_length=1, description="The served model it adapts (only backends serving it load it)."
    )
    tenants: list[str] = Field(
        default_factory=list, description="Tenants that may use it (by name)."
    )
    tiers: list[str] = Field(
        default_factory=list, description="Tiers whose every tenant may use it."
    )
    shared: bool = Field(
        False,
        description="Every tenant may use it. false: only `tenants` and `tiers`; any other gets"
        " 404 `model_not_found`, as for a model that does not exist, and never sees it in"
        " `/v1/models`.",
    )
    price: Price | None = Field(
        None,
        description="Price per million tokens of its requests, in place of `pricing:`'s for its"
        " name; null: `pricing:` decides (its name or a glob), else its base model's price"
        " (free only where neither is priced).",
    )


def adapter_name_ok(name: str) -> str:
    """ValueError for a name vLLM or the cache salt's domain cannot take."""
    if not _NAME.match(name):
        raise ValueError(
            f"adapter name {name!r}: letters, digits and . _ : - only, 128 at most, starting"
            " with a letter or digit"
        )
    if _SALT_SHAPE.match(name):
        raise ValueError(
            f"adapter name {name!r} has the shape of a cache salt (43 base64url characters):"
            " vLLM keys the prefix cache by adapter and salt together"
        )
    return name


def adapter_allowed(adapter: Adapter, tenant: Tenant) -> bool:
    """Whether the tenant may use the adapter: shared, or it or its tier is named."""
    return adapter.shared or tenant.name in adapter.tenants or tenant.tier in adapter.tiers


def adapters_of_tiers(
    adapters: Mapping[str, Adapter], tenants: Collection[Tenant], tiers: Collection[str]
) -> frozenset[str]:
    """The adapters some tenant of ``tiers`` may use (a shared one, one open to its tier, one
    naming it), whatever its model patterns: where a slot may be kept for those tiers."""
    of_tiers = [t for t in tenants if t.tier in tiers]
    return frozenset(
        name for name, a in adapters.items() if any(adapter_allowed(a, t) for t in of_tiers)
    )


def _matches(model: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(model, p) for p in patterns)


def model_visible(
    model: str,
    patterns: list[str] | None,
    adapters: Mapping[str, Adapter],
    tenant: Tenant,
    engine_adapters: Collection[str] = (),
) -> bool:
    """Whether the tenant may see and use ``model``. An adapter of the catalogue: by its own
    rule (``adapter_allowed``), and by the tenant's model patterns unless the adapter names
    the tenant itself (a tenant held to some models is not opened to every shared adapter).
    An adapter an engine serves that the catalogue does not name (removed from it by a
    reload while still loaded, or an engine's own ``--lora-modules``): nobody's. Any other
    model: by the tenant's model patterns."""
    adapter = adapters.get(model)
    if adapter is not None:
        named = tenant.name in adapter.tenants
        return adapter_allowed(adapter, tenant) and (named or _matches(model, patterns))
    if model in engine_adapters:
        return False
    return _matches(model, patterns)


def adapter_prices(
    adapters: Mapping[str, Adapter], pricing: Mapping[str, Price]
) -> dict[str, Price]:
    """``pricing`` with each adapter's price under its exact name (an exact name comes before
    the globs: proxy.config.quotas.price_of): its own ``price``, else its name in
    ``pricing:``, else a glob that matches its name but not its base model's (`lora-*`), else
    its base model's price. An adapter runs its base model on the same engines: never free
    where the base model is priced (red team F5 of round g: the example's shared adapter was
    billed `cost: null`; red team R5: a catch-all `"*": 0` matched the adapter before the base
    model's own price)."""
    merged = dict(pricing)
    for name, adapter in adapters.items():
        base = adapter.base_model
        price = adapter.price if adapter.price is not None else pricing.get(name)
        if price is None:
            price = next(
                (
                    p
                    for pattern, p in pricing.items()
                    if fnmatch.fnmatchcase(name, pattern) and not fnmatch.fnmatchcase(base, pattern)
                ),
                None,
            )
        if price is None:
            price = price_of(pricing, base)
        if price is not None:
            merged[name] = price
    return merged


def adapter_cards(
    adapters: Mapping[str, Adapter],
    tenant: Tenant,
    patterns: list[str] | None,
    served: Callable[[str], bool],
) -> list[dict[str, object]]:
    """/v1/models cards of the tenant's adapters whose base model is ``served``, all in one
    shape whether an engine holds them now or not (vLLM's own card carries the adapter's path
    in ``root``, and which adapters are loaded is other tenants' business)."""
    return [
        {"id": name, "object": "model", "owned_by": "tierproxy", "parent": a.base_model}
        for name, a in adapters.items()
        if served(a.base_model) and model_visible(name, patterns, adapters, tenant)
    ]
