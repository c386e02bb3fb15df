"""The prefix-cache salt per tenant (docs/isolation.md): derived by the proxy, never the
client's, bound into the ticket, checked by the plugin, and keyed into prefix affinity."""

from __future__ import annotations

import json
from typing import Any

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config
from proxy.config.loader import parse_config
from proxy.config.tenants import Tenant, Tier, cache_scope, hash_key
from proxy.policies.prefix import prefix_hash
from proxy.ticket import TICKET_HEADER, decode_ticket, derive_cache_salt, encode_ticket
from proxy.vllm_plugin.verify import salt_matches
from tests.helpers.clock import FakeClock
from tests.helpers.plugin_asgi import App, call, mw_with, refused, signed, ticket
from tests.helpers.rig import BODY, rig

TIER = {"priority": 0, "weight": 1, "max_queue": 1, "queue_timeout_s": 1, "request_timeout_s": 1}


def _tenant(name: str, **extra: Any) -> Tenant:
    return Tenant.model_validate(
        {"name": name, "tier": "t", "keys": [{"sha256": hash_key(name)}], **extra}
    )


def test_the_salt_is_stable_per_scope_unguessable_and_valid_for_vllm() -> None:
    a = derive_cache_salt(SECRET, "tenant:a")
    assert a == derive_cache_salt(SECRET, "tenant:a")  # every replica, every restart
    assert a != derive_cache_salt(SECRET, "tenant:b")
    assert a != derive_cache_salt(SECRET + b"x", "tenant:a")  # needs the secret
    assert len(a) == 43 and not set(a) & set("@/\\\x00")  # vLLM refuses these characters


def test_the_scope_is_the_tenant_its_group_or_its_tiers_group() -> None:
    alone, grouped = Tier.model_validate(TIER), Tier.model_validate({**TIER, "cache_group": "t"})
    assert cache_scope(_tenant("a"), alone) == "tenant:a"
    assert cache_scope(_tenant("a"), grouped) == cache_scope(_tenant("b"), grouped) == "group:t"
    assert cache_scope(_tenant("a", cache_group="team"), grouped) == "group:team"
    # A tenant named like a group does not share that group's cache.
    assert cache_scope(_tenant("team"), alone) != cache_scope(
        _tenant("x", cache_group="team"), alone
    )


def test_prefix_affinity_keys_on_salt_and_prefix() -> None:
    body = {"messages": [{"role": "user", "content": "the same long system prompt " * 20}]}
    h = {s: prefix_hash(body, tokens=64, chars_per_token=4.0, salt=s) for s in ("a", "b", "")}
    assert h["a"] != h["b"] and h["a"] != h[""] and h["a"] is not None
    assert h["a"] == prefix_hash(body, tokens=64, chars_per_token=4.0, salt="a")


def test_the_ticket_carries_the_salt_and_an_older_ticket_reads_as_none() -> None:
    t = ticket(cache_salt="s" * 43)
    assert decode_ticket(encode_ticket(t, SECRET), SECRET).cache_salt == "s" * 43
    old = decode_ticket(encode_ticket(ticket(), SECRET), SECRET)
    assert old.cache_salt == ""
    assert salt_matches(t, {"cache_salt": "s" * 43}) and salt_matches(old, {"cache_salt": "z"})
    assert (
        not salt_matches(t, {"cache_salt": "z"})
        and not salt_matches(t, {})
        and not salt_matches(t, None)
    )


def _config(backend_url: str, groups: dict[str, str] | None = None) -> dict[str, Any]:
    config = make_config([{"url": backend_url, "max_inflight": 4}])
    for t in config["tenants"]:
        if groups and t["name"] in groups:
            t["cache_group"] = groups[t["name"]]
    return config


async def _salts(clock: FakeClock, groups: dict[str, str] | None = None) -> dict[str, str]:
    """The cache_salt the backend received for each tier's tenant, each sending its own salt."""
    backend = FakeVLLM()
    async with backend.serve() as url, rig(_config(url, groups), clock) as r:
        out: dict[str, str] = {}
        for tier in ("high", "normal", "low"):
            resp = await r.client.post(
                "/v1/chat/completions",
                json={**BODY, "cache_salt": "client-chosen"},
                headers=auth(tier),
            )
            assert resp.status == 200, await resp.text()
            body, headers = backend.received[-1].body, backend.received[-1].headers
            t = decode_ticket(headers[TICKET_HEADER], SECRET)
            assert t.cache_salt == body["cache_salt"]  # bound into the ticket
            out[t.tenant] = str(body["cache_salt"])
        return out


async def test_each_tenant_gets_its_own_salt_never_the_clients(clock: FakeClock) -> None:
    salts = await _salts(clock)
    assert "client-chosen" not in salts.values()
    assert len(set(salts.values())) == 3
    for name, salt in salts.items():
        assert salt == derive_cache_salt(SECRET, f"tenant:{name}")


async def test_tenants_of_one_cache_group_share_a_salt(clock: FakeClock) -> None:
    cfg = _config("http://127.0.0.1:1")
    names = [t["name"] for t in cfg["tenants"]]
    salts = await _salts(clock, {names[0]: "team", names[1]: "team"})
    assert salts[names[0]] == salts[names[1]] != salts[names[2]]
    parse_config(json.dumps(_config("http://127.0.0.1:1", {names[0]: "team"})), "t")


async def test_the_plugin_refuses_a_ticket_for_another_salt() -> None:
    body = json.dumps({"model": "tiny", "prompt": "x", "cache_salt": "forged"}).encode()
    app = App()
    status, err = await refused(mw_with(app, require=True), body, signed(body, cache_salt="mine"))
    assert status == 403 and "cache salt" in err["message"] and app.scope == {}
    body = json.dumps({"model": "tiny", "prompt": "x", "cache_salt": "mine"}).encode()
    await call(mw_with(app, require=True), body, signed(body, cache_salt="mine"))
    assert json.loads(app.body)["cache_salt"] == "mine"
