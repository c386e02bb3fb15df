import ast
import base64
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import ticket
from proxy.ticket import (
    MIN_SECRET_BYTES,
    SecretError,
    Ticket,
    TicketError,
    body_digest,
    check_secret,
    content_digest,
    decode_ticket,
    encode_ticket,
)

SECRET = b"shared-secret-for-the-ticket-tests"
T = Ticket(
    tier="high",
    priority=0,
    tenant="chat-app",
    deadline=1.8e9,
    prefill_share=1.0,
    budget=256,
    request_id="abc",
    body_sha256=body_digest(b'{"model":"m"}'),
    issued_at=1.8e9 - 10,
    nonce="n-1",
)


def test_round_trip() -> None:
    assert decode_ticket(encode_ticket(T, SECRET), SECRET) == T


def test_wrong_secret_and_tampering_are_refused() -> None:
    value = encode_ticket(T, SECRET)
    with pytest.raises(TicketError):
        decode_ticket(value, b"other")
    forged = encode_ticket(dataclasses.replace(T, priority=-1000), b"guess")
    with pytest.raises(TicketError):
        decode_ticket(forged, SECRET)
    version, _payload, sig = value.split(".")
    better = encode_ticket(dataclasses.replace(T, priority=-5), SECRET).split(".")[1]
    with pytest.raises(TicketError):
        decode_ticket(f"{version}.{better}.{sig}", SECRET)  # payload swapped, old signature


@pytest.mark.parametrize("value", ["", "v2", "v2.a.b.c", "v2.abc.def", "v2.!!.??", "v2.é.ß"])
def test_malformed(value: str) -> None:
    with pytest.raises(TicketError):
        decode_ticket(value, SECRET)


def test_v1_tickets_are_refused_even_when_signed_with_the_secret() -> None:
    payload = encode_ticket(T, SECRET).split(".")[1]
    signed = f"v1.{payload}"
    sig = ticket._signature(SECRET, signed)
    with pytest.raises(TicketError, match="version"):
        decode_ticket(f"{signed}.{sig}", SECRET)


@pytest.mark.parametrize("value", ["v2.\u00e9.x", b"v2.\xff\xfe.x", b"\x80"])
def test_non_ascii_bytes_are_a_ticket_error_not_a_crash(value: str | bytes) -> None:
    with pytest.raises(TicketError, match="ASCII"):
        decode_ticket(value, SECRET)


def test_body_digest_is_rfc9530_sha256() -> None:
    # RFC 9530 appendix B.1's example: {"hello": "world"} and a newline
    body = b'{"hello": "world"}\n'
    assert content_digest(body) == "sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:"
    assert body_digest(body) != body_digest(body + b" ")


@pytest.mark.parametrize(
    "secret",
    [b"", b"short", b"x" * (MIN_SECRET_BYTES - 1), b"change-me-to-a-long-random-string"],
)
def test_short_or_placeholder_secrets_are_refused(secret: bytes) -> None:
    with pytest.raises(SecretError):
        check_secret(secret)


def test_a_long_random_secret_is_accepted() -> None:
    assert check_secret(b"x" * MIN_SECRET_BYTES) == b"x" * MIN_SECRET_BYTES


def test_no_secret_never_verifies() -> None:
    with pytest.raises(TicketError):
        decode_ticket(encode_ticket(T, SECRET), b"")
    with pytest.raises(ValueError):
        encode_ticket(T, b"")


def test_the_time_limit_is_a_duration_on_the_proxys_clock_alone() -> None:
    assert T.time_limit_s == 10.0  # deadline - issued_at: both stamped by the proxy
    assert dataclasses.replace(T, deadline=T.issued_at - 5).time_limit_s == 0.0


def test_the_v2_wire_format_is_unchanged_for_rolling_upgrades() -> None:
    """Proxy and plugin of different versions meet during an upgrade: the payload keeps
    exactly the v2 fields (a plugin before durations reads ``deadline``, one after reads
    ``deadline - issued_at``; an older proxy's ticket carries both)."""
    payload = encode_ticket(T, SECRET).split(".")[1]
    raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    raw_keys = sorted(raw)
    assert raw_keys == [
        "body_sha256",
        "budget",
        "deadline",
        "issued_at",
        "nonce",
        "prefill_share",
        "priority",
        "request_id",
        "tenant",
        "tier",
    ]
    assert encode_ticket(T, SECRET).startswith("v2.")
    # A bound cache salt adds its one key, which a plugin of before the salt ignores.
    salted = encode_ticket(dataclasses.replace(T, cache_salt="s"), SECRET).split(".")[1]
    raw = json.loads(base64.urlsafe_b64decode(salted + "=" * (-len(salted) % 4)))
    assert sorted(raw) == sorted(["cache_salt", *raw_keys])


@given(st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_input_never_crashes_decoder(value: str | bytes) -> None:
    with contextlib.suppress(TicketError):
        decode_ticket(value, SECRET)


def test_every_xarg_key_carries_the_prefix_the_middleware_strips() -> None:
    keys = [value for name, value in vars(ticket).items() if name.startswith("XARG_")]
    assert len(keys) == 7  # the prefix and six keys
    assert all(key.startswith(ticket.XARG_PREFIX) for key in keys)


def test_plugin_flags_load_both_classes_with_priority_scheduling() -> None:
    flags = dict(zip(ticket.PLUGIN_FLAGS[::2], ticket.PLUGIN_FLAGS[1::2], strict=True))
    assert flags == {
        "--scheduling-policy": "priority",
        "--middleware": ticket.MIDDLEWARE_CLASS,
        "--scheduler-cls": ticket.SCHEDULER_CLASS,
    }


def test_the_contract_module_imports_neither_aiohttp_nor_vllm() -> None:
    tree = ast.parse(Path(ticket.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported}.isdisjoint({"aiohttp", "vllm", "proxy"})


@pytest.mark.parametrize("secret", [b"short", b"change-me-to-a-long-random-string"])
def test_the_proxy_refuses_to_start_with_a_weak_secret(secret: bytes) -> None:
    import yaml

    from proxy.bench.inproc import SECRET as GOOD
    from proxy.bench.inproc import make_config
    from proxy.config.loader import ConfigError, parse_config
    from proxy.server.app import create_app

    loaded = parse_config(yaml.safe_dump(make_config([{"url": "http://127.0.0.1:9"}])))
    with pytest.raises(ConfigError, match="ticket secret"):
        create_app(loaded, secret=secret)
    create_app(loaded, secret=GOOD)  # the suite's own secret is long enough


def test_the_payload_is_the_sorted_json_of_the_fields() -> None:
    """The wire format the plugin verifies: ``json.dumps(asdict(t), sort_keys=True)``, compact
    (encode_ticket builds it without asdict, for speed)."""
    ticket = Ticket("high", 0, "acme", 1.7e9 + 0.5, 0.25, 512, "rid", "sha", 1.7e9, "nonce")
    payload = ticket_payload(encode_ticket(ticket, b"k" * 32))
    fields = dataclasses.asdict(ticket)
    del fields["cache_salt"]  # written only when set: an unsalted ticket is the v2 of before
    expected = json.dumps(fields, separators=(",", ":"), sort_keys=True)
    assert base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)) == expected.encode()
    salted = dataclasses.replace(ticket, cache_salt="salt")
    payload = ticket_payload(encode_ticket(salted, b"k" * 32))
    expected = json.dumps(dataclasses.asdict(salted), separators=(",", ":"), sort_keys=True)
    assert base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)) == expected.encode()


def ticket_payload(value: str) -> str:
    return value.split(".")[1]
