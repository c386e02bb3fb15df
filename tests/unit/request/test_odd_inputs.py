"""Keys read from request headers may hold bytes that are not UTF-8 (aiohttp keeps them as lone
surrogates): hashing them never raises (a 500 "this is a bug" for anyone, issue 22 #13) and
finds no tenant (401). Gzip bodies of many members are refused (issue 22 #2)."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from proxy.api.errors import ProxyError
from proxy.config.tenants import hash_key
from proxy.request.body import MAX_GZIP_MEMBERS, decode
from tests.helpers.encoding_cases import BODY, members

RAW = [b"\xff\xfe\xfd", b"\xc3\x28", b"\xed\xa0\x80", b"caf\xe9"]


@pytest.mark.parametrize("raw", RAW)
def test_a_key_that_is_not_utf8_hashes_to_its_bytes(raw: bytes) -> None:
    as_read = raw.decode("utf-8", "surrogateescape")  # as aiohttp hands a header value over
    assert hash_key(as_read) == hashlib.sha256(raw).hexdigest()


def test_any_lone_surrogate_hashes_without_raising() -> None:
    assert len(hash_key("key-\ud800")) == 64


def test_a_utf8_key_hashes_as_before() -> None:
    assert hash_key("café-key") == hashlib.sha256("café-key".encode()).hexdigest()


def test_a_few_gzip_members_decode() -> None:
    assert decode(members(BODY, MAX_GZIP_MEMBERS), "gzip", 1 << 20) == BODY


def test_more_gzip_members_are_refused_before_the_rest_is_walked() -> None:
    empty = gzip.compress(b"")
    with pytest.raises(ProxyError) as refused:
        decode(empty * 150_000, "gzip", 8 << 20)
    assert refused.value.status == 400 and "members" in refused.value.message
