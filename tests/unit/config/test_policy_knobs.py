"""Each policy's knobs nested under its name in `policies:`; the flat names of before still
load, to the same values, with a deprecation warning (one release)."""

from __future__ import annotations

import logging

import pytest

from proxy.config.deprecated import FLAT_POLICY_KNOBS
from proxy.config.loader import ConfigError, parse_config
from proxy.config.scheduling import Policies
from tests.helpers.paths import REPO

BASE = """
tiers:
  normal: {priority: 1, weight: 1, max_queue: 4, queue_timeout_s: 2, request_timeout_s: 5}
backends: [{url: "http://127.0.0.1:8100"}]
"""

NESTED = """
policies:
  backends: kv_aware
  prefix_affinity: {prefix_tokens: 64, memory: 50}
  kv_aware: {room_weight_best: 2.0, room_weight_worst: 0.5, hold_s: 0.25}
  vtc: {cached_prompt_charge: 0.3}
"""

FLAT = """
policies:
  backends: kv_aware
  prefix_tokens: 64
  prefix_memory: 50
  kv_room_weight_best: 2.0
  kv_room_weight_worst: 0.5
  kv_hold_s: 0.25
  cached_prompt_charge: 0.3
"""


def test_the_nested_form_sets_each_policys_knobs_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tierproxy"):
        loaded = parse_config(BASE + NESTED)
    p = loaded.config.policies
    assert (p.prefix_affinity.prefix_tokens, p.prefix_affinity.memory) == (64, 50)
    assert (p.kv_aware.room_weight_best, p.kv_aware.room_weight_worst) == (2.0, 0.5)
    assert (p.kv_aware.hold_s, p.vtc.cached_prompt_charge) == (0.25, 0.3)
    assert loaded.warnings == () and "deprecated" not in caplog.text


def test_the_flat_names_load_to_the_same_values_with_a_deprecation_warning_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tierproxy"):
        loaded = parse_config(BASE + FLAT, source="old.yaml")
    assert loaded.config.policies == parse_config(BASE + NESTED).config.policies
    assert len(loaded.warnings) == len(FLAT_POLICY_KNOBS)
    for flat, (policy, name) in FLAT_POLICY_KNOBS.items():
        line = f"policies.{flat} is deprecated"
        assert any(line in w and f"policies.{policy}.{name}" in w for w in loaded.warnings)
        assert f"old.yaml: {line}" in caplog.text


def test_a_flat_name_mixes_with_the_nested_form_of_another_knob() -> None:
    text = BASE + "policies: {kv_hold_s: 3, kv_aware: {room_weight_best: 4}}\n"
    knobs = parse_config(text).config.policies.kv_aware
    assert (knobs.hold_s, knobs.room_weight_best, knobs.room_weight_worst) == (3.0, 4.0, 0.1)


def test_one_knob_set_both_ways_is_an_error_that_names_both() -> None:
    with pytest.raises(ConfigError, match=r"kv_hold_s and kv_aware.hold_s"):
        parse_config(BASE + "policies: {kv_hold_s: 3, kv_aware: {hold_s: 1}}\n")


def test_a_flat_value_out_of_bounds_is_refused_as_before() -> None:
    with pytest.raises(ConfigError, match=r"policies.kv_aware.hold_s"):
        parse_config(BASE + "policies: {kv_hold_s: 31}\n")


def test_defaults_are_unchanged() -> None:
    p = Policies()
    assert (p.prefix_affinity.prefix_tokens, p.prefix_affinity.memory) == (256, 10_000)
    # room_weight_best 0.5 since issue 32 (1.0 before): across the family, with engines busy,
    # the best tier left its cache for a moment's free slot and computed its prompt again.
    assert (p.kv_aware.room_weight_best, p.kv_aware.room_weight_worst) == (0.5, 0.1)
    # hold_s 10 since issue 32 (3 s, then 10 s once the cost model counted prefill only):
    # shorter holds moved conversations off their cache across the family.
    assert (p.kv_aware.hold_s, p.vtc.cached_prompt_charge) == (10.0, 0.1)
    assert p.kv_aware.work_weight == 0.5


def test_the_examples_commented_policies_block_is_the_nested_form() -> None:
    lines = (REPO / "configs/example.yaml").read_text(encoding="utf-8").splitlines()
    start = lines.index("# policies:")
    block = ["policies:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        block.append(line[1:])
    loaded = parse_config(BASE + "\n".join(block) + "\n")
    assert loaded.warnings == () and loaded.config.policies == Policies()
    keys = [line.split("#")[0].strip() for line in block]
    assert {"prefix_affinity:", "kv_aware:", "vtc:"} <= set(keys)
