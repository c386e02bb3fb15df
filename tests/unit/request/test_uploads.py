"""The per-tenant bound on bodies coming in (proxy/request/uploads.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from proxy.bench.inproc import make_config
from proxy.config.loader import parse_config
from proxy.request.uploads import TenantUploads, UploadRefused, upload_bound


def config(**sections: Any) -> Any:
    return parse_config(yaml.safe_dump(make_config([{"url": "http://b:1"}], **sections))).config


def test_the_bound_defaults_to_a_quarter_of_the_connections() -> None:
    assert upload_bound(config(server={"max_connections": 40})) == 10
    assert upload_bound(config(server={"max_connections": 2})) == 1
    assert upload_bound(config(input={"max_uploads_per_tenant": 3})) == 3


def test_each_tenant_has_its_own_count_and_every_end_gives_its_place_back() -> None:
    uploads, cfg = TenantUploads(), config(input={"max_uploads_per_tenant": 2})
    with uploads.body_of("a", cfg), uploads.body_of("a", cfg):
        with pytest.raises(UploadRefused) as refused, uploads.body_of("a", cfg):
            pass
        assert refused.value.status == 429 and refused.value.code == "too_many_uploads"
        with uploads.body_of("b", cfg):
            assert uploads.reading.held == {"a": 2, "b": 1}
    with pytest.raises(TimeoutError), uploads.body_of("a", cfg):
        raise TimeoutError  # a body that timed out (or a client that left) ends its count too
    assert uploads.reading.held == {}
