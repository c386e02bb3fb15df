"""`adapters:`: who may use which adapter (a private one answers the same 404 as a model that does
not exist), names that could stand for a cache salt or a base model refused, per-adapter
prices; an adapter an engine serves that the catalogue does not name is nobody's; a tenant held
to some models is not opened to every shared adapter (red team 2026-12-02, findings 1, 2, 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.api.errors import ProxyError
from proxy.backends.pool import BackendPool
from proxy.config.adapters import adapter_cards
from proxy.config.backends import BackendHealth
from proxy.config.loader import load_config
from proxy.config.quotas import Price, price_of
from proxy.config.schema import Config
from proxy.policies.backends import LeastUtilised
from proxy.request.tenancy import check_model
from proxy.ticket import derive_cache_salt

KEY = {"sha256": "0" * 64}


def _config(**adapters: Any) -> Config:
    return Config.model_validate(
        {
            "tiers": {
                "t": {
                    "priority": 0,
                    "weight": 1,
                    "max_queue": 1,
                    "queue_timeout_s": 1,
                    "request_timeout_s": 1,
                },
            },
            "tenants": [
                {"name": "acme", "tier": "t", "keys": [KEY]},
                {"name": "globex", "tier": "t", "keys": [{"sha256": "1" * 64}]},
            ],
            "backends": [{"url": "http://b:1", "max_loras": 2, "load_adapters": True}],
            "pricing": {"tiny": {"input": 1, "output": 1}, "*": {"input": 9, "output": 9}},
            "adapters": adapters,
        }
    )


def _pool(config: Config, engine_adapters: tuple[str, ...] = ()) -> BackendPool:
    """One backend whose /v1/models lists the base model `tiny` and ``engine_adapters``."""
    pool = BackendPool(config.backends, BackendHealth(), LeastUtilised())
    pool.adapters = {name: a.base_model for name, a in config.adapters.items()}
    state = pool.states["http://b:1"]
    state.models = frozenset({"tiny", *engine_adapters})
    strays: list[dict[str, object]] = [
        {"id": name, "parent": "tiny", "root": f"/srv/{name}"} for name in engine_adapters
    ]
    state.model_cards = ({"id": "tiny"}, *strays)
    state.listed_adapters = frozenset(engine_adapters)  # as the monitor's probe sets it
    return pool


def _refusal(
    config: Config, model: str, tenant: int, engine_adapters: tuple[str, ...] = ()
) -> ProxyError | None:
    t = config.tenants[tenant]
    try:
        pool = _pool(config, engine_adapters)
        check_model(pool, model, t, config.tiers[t.tier], config.adapters)
    except ProxyError as err:
        return err
    return None


def test_a_private_adapter_is_the_same_404_as_a_model_that_does_not_exist() -> None:
    config = _config(**{"acme-sql": {"path": "/a", "base_model": "tiny", "tenants": ["acme"]}})
    assert _refusal(config, "acme-sql", tenant=0) is None
    theirs, unknown = _refusal(config, "acme-sql", 1), _refusal(config, "nope", 1)
    assert theirs is not None and unknown is not None
    assert theirs.status == unknown.status == 404
    assert (theirs.type, theirs.code, theirs.param) == (unknown.type, unknown.code, unknown.param)
    assert theirs.message.replace("acme-sql", "nope") == unknown.message
    # Its /v1/models cards: only the tenant's own, never a path.
    served = {"tiny"}.__contains__
    cards = adapter_cards(config.adapters, config.tenants[0], None, served)
    assert cards == [
        {"id": "acme-sql", "object": "model", "owned_by": "tierproxy", "parent": "tiny"}
    ]
    assert adapter_cards(config.adapters, config.tenants[1], None, served) == []
    assert adapter_cards(config.adapters, config.tenants[0], None, {"llama"}.__contains__) == []


def test_an_adapter_the_engine_serves_outside_the_catalogue_is_nobodys() -> None:
    # Removed from `adapters:` by a reload while still loaded (or an engine's own
    # --lora-modules): it answered every tenant, unpriced, outside the slot count.
    config = _config()
    for tenant in (0, 1):
        err = _refusal(config, "acme-sql", tenant, engine_adapters=("acme-sql",))
        assert err is not None and err.status == 404
        assert "acme-sql" not in err.message.split("does not exist")[1]  # not in the hint
    assert _refusal(config, "tiny", 1, engine_adapters=("acme-sql",)) is None


def test_a_tenants_model_patterns_bound_the_shared_adapters_it_may_use() -> None:
    config = Config.model_validate(
        {
            **_config().model_dump(mode="json", exclude={"adapters"}),
            "tenants": [
                {"name": "acme", "tier": "t", "keys": [KEY], "models": ["other-*"]},
                {"name": "globex", "tier": "t", "keys": [{"sha256": "1" * 64}]},
            ],
            "adapters": {
                "shared": {"path": "/s", "base_model": "tiny", "shared": True},
                "other-x": {"path": "/x", "base_model": "tiny", "shared": True},
                "mine": {"path": "/m", "base_model": "tiny", "tenants": ["acme"]},
            },
        }
    )
    held = config.tenants[0]
    assert _refusal(config, "shared", 0) is not None  # not within acme's patterns
    assert _refusal(config, "other-x", 0) is None  # within them
    assert _refusal(config, "mine", 0) is None  # named for acme itself
    patterns = held.models
    cards = adapter_cards(config.adapters, held, patterns, {"tiny"}.__contains__)
    assert [c["id"] for c in cards] == ["other-x", "mine"]
    assert _refusal(config, "shared", 1) is None  # a tenant without patterns: every shared


def test_shared_and_tier_adapters_and_one_no_backend_can_serve() -> None:
    config = _config(
        shared={"path": "/s", "base_model": "tiny", "shared": True},
        tiered={"path": "/t", "base_model": "tiny", "tiers": ["t"]},
        orphan={"path": "/o", "base_model": "llama", "shared": True},
    )
    assert _refusal(config, "shared", 1) is None and _refusal(config, "tiered", 1) is None
    err = _refusal(config, "orphan", 0)  # no backend serves its base model
    assert err is not None and err.status == 404


@pytest.mark.parametrize(
    ("adapters", "wanted"),
    [
        ({"x": {"path": "/x", "base_model": "tiny", "tenants": ["nobody"]}}, "unknown tenant"),
        ({"x": {"path": "/x", "base_model": "tiny", "tiers": ["gold"]}}, "unknown tier"),
        ({"bad/name": {"path": "/x", "base_model": "tiny"}}, "letters, digits"),
        ({"x": {"path": "  ", "base_model": "tiny"}}, "path"),
        # Named like a base model: vLLM refuses the load, and every other tenant lost `tiny`.
        ({"tiny": {"path": "/x", "base_model": "tiny", "tenants": ["acme"]}}, "base model"),
        (
            {derive_cache_salt(b"s" * 32, "tenant:acme"): {"path": "/x", "base_model": "tiny"}},
            "shape of a cache salt",
        ),
    ],
)
def test_bad_adapters_are_refused(adapters: dict[str, Any], wanted: str) -> None:
    with pytest.raises(ValidationError, match=wanted):
        _config(**adapters)


def test_an_adapter_price_comes_before_the_pricing_globs() -> None:
    config = _config(
        priced={
            "path": "/p",
            "base_model": "tiny",
            "shared": True,
            "price": {"input": 3, "output": 4},
        },
        unpriced={"path": "/u", "base_model": "tiny", "shared": True},
    )
    priced = price_of(config.prices, "priced")
    unpriced = price_of(config.prices, "unpriced")
    assert priced is not None and (priced.input, priced.output) == (3, 4)
    # A catch-all matches its base model too: the base model's own price comes first.
    assert unpriced is not None and unpriced.input == 1


def test_a_catch_all_price_never_makes_an_adapter_cheaper_than_its_base_model() -> None:
    """Red team R5: with `tiny` priced and `"*": 0`, an unpriced adapter of tiny was free,
    the priced base model run for nothing. A glob for adapters alone (`lora-*`) still holds."""
    config = _config(
        lora_x={"path": "/x", "base_model": "tiny", "shared": True},
        other={"path": "/o", "base_model": "tiny", "shared": True},
    )
    config = config.model_copy(
        update={
            "pricing": {
                "tiny": Price(input=1, output=2),
                "lora_*": Price(input=5, output=5),
                "*": Price(input=0, output=0),
            }
        }
    )
    other = price_of(config.prices, "other")
    lora = price_of(config.prices, "lora_x")
    assert other is not None and (other.input, other.output) == (1, 2)
    assert lora is not None and lora.input == 5


def test_an_adapter_without_a_price_is_billed_at_its_base_models() -> None:
    """Red team F5 of round g: configs/example.yaml's shared adapter had no price while its
    base model had one, and its requests were recorded `cost: null` (free)."""
    config = _config(shared_one={"path": "/s", "base_model": "tiny", "shared": True})
    config = config.model_copy(
        update={
            "pricing": {"tiny": Price(input=0.15, output=0.6), "other-*": Price(input=1, output=1)}
        }
    )
    price = price_of(config.prices, "shared_one")
    assert price is not None and (price.input, price.output) == (0.15, 0.6)
    example = load_config(Path(__file__).parents[3] / "configs" / "example.yaml").config
    for name, adapter in example.adapters.items():  # none of the example's is free
        assert price_of(example.prices, name) is not None, name
        assert price_of(example.pricing, adapter.base_model) is not None


def test_the_404_cuts_a_long_name_and_suggests_only_servable_adapters() -> None:
    config = _config(
        served={"path": "/s", "base_model": "tiny", "shared": True},
        orphan={"path": "/o", "base_model": "llama", "shared": True},  # no backend runs llama
    )
    err = _refusal(config, "x" * 100_000, 0)
    assert err is not None and err.status == 404
    assert len(err.message) < 400 and f"`{'x' * 256}...`" in err.message
    hint = err.message.split("Valid aliases:")[1]
    assert "served" in hint and "orphan" not in hint  # on main: both named
