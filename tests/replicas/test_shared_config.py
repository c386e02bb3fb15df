"""The ``shared_state:`` section: absent means no Redis at all; bad values name the field."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from proxy.bench.inproc import SECRET, make_config
from proxy.config.loader import ConfigError, parse_config
from proxy.replicas.limits import SharedLimitRegistry
from proxy.scheduling.limits import LimitRegistry
from proxy.server.app import create_app
from proxy.server.state import STATE


def _app_limits(extra: dict[str, Any]) -> object:
    cfg = make_config([{"url": "http://127.0.0.1:1"}], **extra)
    app = create_app(parse_config(yaml.safe_dump(cfg), "test"), secret=SECRET)
    return app[STATE].limits


def test_without_the_section_limits_stay_local_and_nothing_shared_exists() -> None:
    assert type(_app_limits({})) is LimitRegistry


def test_with_the_section_limits_are_shared() -> None:
    limits = _app_limits({"shared_state": {"url": "redis://127.0.0.1:1/0"}})
    assert isinstance(limits, SharedLimitRegistry)
    assert limits.store.cfg.on_failure == "local" and limits.store.cfg.call_timeout_s == 0.25


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"on_failure": "ignore"}, "on_failure"),
        ({"call_timeout_s": 0}, "call_timeout_s"),
        ({"lease_ttl_s": -1}, "lease_ttl_s"),
        ({"redis": "x"}, "redis"),
    ],
)
def test_bad_values_name_the_field(section: dict[str, Any], field: str) -> None:
    cfg = make_config([{"url": "http://127.0.0.1:1"}], shared_state=section)
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_dump(cfg), "test")
    assert any(f"shared_state.{field}" in p for p in err.value.problems), err.value.problems
