"""``reload_verdicts`` (proxy.request.pending): what a reload says of each admitted request that
still waits for a backend, a plain function of the requests (in queue order), the new config,
the counters and a wall clock given (red team F3 of rt4: queued requests of a revoked key, or
past a lowered quota, were served after the reload)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
import yaml

from proxy.api.errors import ProxyError
from proxy.bench.inproc import KEYS, make_config
from proxy.config.loader import parse_config
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import hash_key
from proxy.request.admitted import Admitted
from proxy.request.inbound import parse_body
from proxy.request.pending import reload_verdicts
from proxy.request.quota_gate import quota_limits
from proxy.scheduling.quotas import QuotaAsk, QuotaLedger, QuotaVerdict
from tests.helpers.rig import tenant

WALL = datetime(2026, 12, 1, 18, tzinfo=UTC).timestamp()
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}


def config(quota: dict[str, float] | None = None, **normal: Any) -> dict[str, Any]:
    limits = {"quota": quota} if quota else {}
    tenants = [
        tenant("tenant-high", "high", KEYS["high"]),
        {**tenant("tenant-normal", "normal", KEYS["normal"], **limits), **normal},
    ]
    return make_config([{"url": "http://127.0.0.1:1"}], tenants=tenants)


def loaded(cfg: dict[str, Any]) -> LoadedConfig:
    return parse_config(yaml.safe_dump(cfg), "test")


class Book:
    """The quota ledger each admitted request reserved on, as QuotaGate does."""

    def __init__(self) -> None:
        self.ledger = QuotaLedger()

    def admit(self, at: LoadedConfig, who: str, arrival: float) -> Admitted:
        tenant = at.tenant_for_key(KEYS[who])
        assert tenant is not None
        cfg = at.config
        tier = cfg.tiers[tenant.tier]
        parsed = parse_body(orjson.dumps(BODY), "chat", tier, cfg.limits, cfg.scheduling)
        adm = Admitted(cfg, tenant, parsed, f"r{arrival}", arrival)
        adm.key_hash = hash_key(KEYS[who])
        limits = quota_limits(cfg, tenant)
        if limits:
            tokens = float(parsed.prompt_upper_bound + (parsed.output_upper_bound or 0))
            ask = QuotaAsk(tenant.name, limits, tokens, 0.0)
            adm.quota_hold = self.ledger.try_reserve(ask, WALL).hold
            assert adm.quota_hold is not None
        return adm

    def used(self, tenant: str, limits: Mapping[str, float]) -> Mapping[str, float]:
        report = self.ledger.usage(tenant, limits, WALL)
        return {name: float(entry["used"]) for name, entry in report.items()}


def code(verdict: object) -> str | None:
    if verdict is None:
        return None
    if isinstance(verdict, QuotaVerdict):
        return f"quota:{verdict.which}"
    assert isinstance(verdict, ProxyError)
    return verdict.code


def test_a_key_revoked_removed_or_moved_gets_the_401_a_new_request_gets() -> None:
    book, before = Book(), loaded(config())
    waiting = [book.admit(before, "normal", 1.0), book.admit(before, "high", 2.0)]
    revoked = config()
    revoked["tenants"][1]["keys"] = [{"sha256": "0" * 64}]
    moved = config()  # the normal tenant's key is now the high tenant's
    moved["tenants"][0]["keys"].append(moved["tenants"][1]["keys"].pop())
    moved["tenants"][1]["keys"] = [{"sha256": "1" * 64}]
    removed = config()
    del removed["tenants"][1]
    for after in (revoked, moved, removed):
        verdicts = reload_verdicts(waiting, loaded(after), book.used, WALL)
        assert [code(v) for v in verdicts] == ["invalid_api_key", None]


def test_a_key_past_a_new_expiry_gets_expired_api_key() -> None:
    book, before = Book(), loaded(config())
    waiting = [book.admit(before, "normal", 1.0)]
    expiring = config()
    expiring["tenants"][1]["keys"][0]["expires_at"] = "2026-12-01T17:00:00Z"  # an hour ago
    assert [code(v) for v in reload_verdicts(waiting, loaded(expiring), book.used, WALL)] == [
        "expired_api_key"
    ]
    later = config()
    later["tenants"][1]["keys"][0]["expires_at"] = "2026-12-01T19:00:00Z"
    assert reload_verdicts(waiting, loaded(later), book.used, WALL) == [None]


def test_a_lowered_quota_keeps_the_earliest_that_fit_in_queue_order() -> None:
    book, before = Book(), loaded(config({"tokens_per_day": 100_000}))
    # Queue order is the list's (the mechanism sorts by arrival): the first is the earliest.
    waiting = [book.admit(before, "normal", float(i)) for i in range(6)]
    assert waiting[0].quota_hold is not None
    each = waiting[0].quota_hold.tokens
    after = loaded(config({"tokens_per_day": 2.5 * each}))
    verdicts = reload_verdicts(waiting, after, book.used, WALL)
    assert [code(v) for v in verdicts] == [None, None] + ["quota:tokens_per_day"] * 4
    third = verdicts[2]
    assert isinstance(third, QuotaVerdict)
    assert (third.used, third.asked, third.limit) == (2 * each, each, 2.5 * each)


def test_unchanged_limits_leave_the_tenant_alone() -> None:
    book, before = Book(), loaded(config({"tokens_per_day": 100_000}))
    waiting = [book.admit(before, "normal", float(i)) for i in range(3)]
    book.ledger.add("tenant-normal", "tokens_per_day", "2026-12-01", 10**6)  # past it already
    after = loaded(config({"tokens_per_day": 100_000}, weight=3))  # another change of the tenant
    assert reload_verdicts(waiting, after, book.used, WALL) == [None, None, None]


def test_a_new_budget_refuses_an_unpriced_request_as_admission_does() -> None:
    book, before = Book(), loaded(config())
    waiting = [book.admit(before, "normal", 1.0)]
    after = loaded(config({"budget_per_month": 5.0}))
    assert [code(v) for v in reload_verdicts(waiting, after, book.used, WALL)] == [
        "model_not_priced"
    ]


def test_a_counter_it_never_reserved_on_sends_it_again() -> None:
    """Red team, stop 57: a tenant given its first quota by a reload ran its queued requests
    uncharged (2,415 tokens run after a limit of 100, its counter at 0). A waiting request
    that reserved nothing on a counter its tenant now has is answered 503 ``config_changed``:
    sent again, it is admitted against the new limits. A limit removed keeps it."""
    book, free = Book(), loaded(config())
    unreserved = [book.admit(free, "normal", 1.0)]
    assert unreserved[0].quota_hold is None
    first = loaded(config({"tokens_per_day": 100_000}))
    assert [code(v) for v in reload_verdicts(unreserved, first, book.used, WALL)] == [
        "config_changed"
    ]
    day = loaded(config({"tokens_per_day": 100_000}))
    reserved = [book.admit(day, "normal", 2.0)]
    added = loaded(config({"tokens_per_day": 100_000, "tokens_per_month": 10**7}))
    assert [code(v) for v in reload_verdicts(reserved, added, book.used, WALL)] == [
        "config_changed"
    ]
    assert reload_verdicts(reserved, free, book.used, WALL) == [None]  # no quota any more
