import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import ticket
from proxy.ticket import Ticket, TicketError, decode_ticket, encode_ticket

SECRET = b"shared-secret"
T = Ticket(
    tier="high",
    priority=0,
    tenant="chat-app",
    deadline=1.8e9,
    prefill_share=1.0,
    budget=256,
    request_id="abc",
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


@pytest.mark.parametrize("value", ["", "v1", "v1.a.b.c", "v2.abc.def", "v1.!!.??"])
def test_malformed(value: str) -> None:
    with pytest.raises(TicketError):
        decode_ticket(value, SECRET)


def test_no_secret_never_verifies() -> None:
    with pytest.raises(TicketError):
        decode_ticket(encode_ticket(T, SECRET), b"")
    with pytest.raises(ValueError):
        encode_ticket(T, b"")


def test_expiry() -> None:
    assert T.expired(1.8e9) and not T.expired(1.8e9 - 1)


@given(st.text(max_size=200))
def test_arbitrary_input_never_crashes_decoder(value: str) -> None:
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
