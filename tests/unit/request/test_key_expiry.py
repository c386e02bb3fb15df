"""A key's ``expires_at`` is enforced on every request (and admin call) by an injected wall
clock: 401 ``expired_api_key`` naming the time, only to a caller holding that very key."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

import orjson
import pytest
import yaml

from proxy.api.errors import ProxyError
from proxy.bench.inproc import make_config
from proxy.config.loader import parse_config, summarize
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import KeySpec, hash_key
from proxy.request.auth import authenticate, authenticate_admin
from tests.helpers.clock import FakeClock

EXPIRES = datetime(2026, 6, 30, 12, 0, tzinfo=UTC)
AT = EXPIRES.timestamp()


def _loaded(*specs: dict[str, Any], admin: list[dict[str, Any]] | None = None) -> LoadedConfig:
    tenants = [{"name": "t", "tier": "high", "keys": list(specs)}]
    config = make_config([{"url": "http://127.0.0.1:9"}], tenants=tenants)
    if admin:
        config["admin_keys"] = admin
    return parse_config(yaml.safe_dump(config))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(ProxyError) as exc:
        call()
    assert exc.value.status == 401
    body = orjson.loads(exc.value.response().body)  # type: ignore[arg-type]
    error: dict[str, Any] = body["error"]
    return error


def test_a_key_works_until_its_expiry_then_gets_a_clear_401() -> None:
    loaded = _loaded(
        {"sha256": hash_key("old"), "expires_at": "2026-06-30T12:00:00Z"},
        {"sha256": hash_key("new")},
    )
    clock = FakeClock(AT - 1)
    assert authenticate(_bearer("old"), loaded, clock).name == "t"
    clock.advance(1)  # expires_at itself is past
    error = _refusal(lambda: authenticate(_bearer("old"), loaded, clock))
    assert error["code"] == "expired_api_key" and error["type"] == "authentication_error"
    assert error["message"].startswith("API key expired at 2026-06-30T12:00:00Z")
    assert authenticate(_bearer("new"), loaded, clock).name == "t"  # never expires


def test_an_unknown_key_learns_nothing_about_expiry() -> None:
    loaded = _loaded({"sha256": hash_key("old"), "expires_at": "2026-06-30T12:00:00Z"})
    error = _refusal(lambda: authenticate(_bearer("other"), loaded, FakeClock(AT + 10)))
    assert error["code"] == "invalid_api_key" and "expired" not in error["message"]


def test_the_clock_is_read_only_for_keys_with_an_expiry() -> None:
    loaded = _loaded({"sha256": hash_key("k")})

    def no_clock() -> float:
        raise AssertionError("the wall clock was read for a key without expires_at")

    assert authenticate(_bearer("k"), loaded, no_clock).name == "t"
    assert loaded.key_expires_at == {}


def test_admin_keys_expire_too() -> None:
    loaded = _loaded(
        {"sha256": hash_key("k")},
        admin=[{"sha256": hash_key("adm"), "expires_at": "2026-06-30T12:00:00Z"}],
    )
    authenticate_admin(_bearer("adm"), loaded, FakeClock(AT - 1))
    error = _refusal(lambda: authenticate_admin(_bearer("adm"), loaded, FakeClock(AT)))
    assert error["code"] == "expired_api_key"


def test_an_env_key_can_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_KEY", "from-the-environment")
    loaded = _loaded({"env": "TEAM_KEY", "expires_at": "2026-06-30T12:00:00Z"})
    error = _refusal(lambda: authenticate(_bearer("from-the-environment"), loaded, FakeClock(AT)))
    assert error["code"] == "expired_api_key"


def test_a_key_listed_twice_expires_at_its_earliest_time_whatever_the_order() -> None:
    """One rule in every order (attack round 2, k02: untimed then expired was 401, expired then
    untimed 200): the earliest expires_at of any listing; a listing without one does not undo
    it (a rotation's expiry on one listing would otherwise never take effect)."""
    digest = hash_key("k")
    timed = {"sha256": digest, "expires_at": "2026-06-30T12:00:00Z"}
    later = {"sha256": digest, "expires_at": "2027-01-01T00:00:00Z"}
    untimed = {"sha256": digest}
    for listings in ([timed, later], [later, timed], [timed, untimed], [untimed, timed]):
        loaded = _loaded(*listings)
        assert loaded.key_expires_at == {digest: AT}, listings
        error = _refusal(lambda: authenticate(_bearer("k"), loaded, FakeClock(AT)))  # noqa: B023
        assert error["code"] == "expired_api_key"
        # `tierproxy check` says so: revoking one listing would leave the other.
        assert len(loaded.warnings) == 1 and "lists this key twice" in loaded.warnings[0]
        assert "tenants.0.keys.1 (line" in loaded.warnings[0]
        assert "warning: tenants.0.keys.1" in summarize(loaded)
    assert _loaded(untimed, untimed).key_expires_at == {}
    assert _loaded(timed).warnings == ()


@pytest.mark.parametrize(
    "written",
    [
        "2026-06-30T12:00:00Z",
        "2026-06-30T12:00:00",  # no zone: UTC
        "2026-06-30T14:00:00+02:00",
        datetime(2026, 6, 30, 12, 0),  # what YAML makes of an unquoted time without a zone
    ],
)
def test_expires_at_is_read_as_utc(written: object) -> None:
    assert KeySpec.model_validate({"sha256": "a" * 64, "expires_at": written}).expires_at == EXPIRES


def test_a_date_expires_at_its_utc_midnight_and_ids_are_checked() -> None:
    spec = KeySpec.model_validate({"sha256": "a" * 64, "expires_at": date(2026, 7, 1)})
    assert spec.expires_at == datetime(2026, 7, 1, tzinfo=UTC)
    assert KeySpec(sha256="ab" * 32, id="abababababab").key_id == "abababababab"
    assert KeySpec(sha256="ab" * 32).key_id == "abababababab"
    assert KeySpec(env="X").key_id == "env:X"
    with pytest.raises(ValueError, match="not the start"):
        KeySpec(sha256="ab" * 32, id="cdcdcdcd")
    with pytest.raises(ValueError):
        KeySpec.model_validate({"sha256": "a" * 64, "expires_at": "next tuesday"})
