"""Config names kept for one release after they moved: `policies:`' flat knobs (before
2026-12), now nested under their policy's name. Read both; warn about the old."""

from __future__ import annotations

from typing import Any

# Flat name -> (the policy it belongs to, its name there).
FLAT_POLICY_KNOBS: dict[str, tuple[str, str]] = {
    "prefix_tokens": ("prefix_affinity", "prefix_tokens"),
    "prefix_memory": ("prefix_affinity", "memory"),
    "kv_room_weight_best": ("kv_aware", "room_weight_best"),
    "kv_room_weight_worst": ("kv_aware", "room_weight_worst"),
    "kv_hold_s": ("kv_aware", "hold_s"),
    "cached_prompt_charge": ("vtc", "cached_prompt_charge"),
}


def nest_flat_policy_knobs(data: Any) -> Any:
    """``policies:`` as given, its flat knobs moved under their policy; a knob set both ways
    is an error (which one was meant is not ours to guess)."""
    if not isinstance(data, dict) or not FLAT_POLICY_KNOBS.keys() & data.keys():
        return data
    out = dict(data)
    for flat, (policy, name) in FLAT_POLICY_KNOBS.items():
        if flat not in out:
            continue
        nested = out.get(policy)
        nested = dict(nested) if isinstance(nested, dict) else {}
        if name in nested:
            raise ValueError(f"{flat} and {policy}.{name} are the same knob: keep only the latter")
        nested[name] = out.pop(flat)
        out[policy] = nested
    return out


def flat_policy_warnings(data: Any) -> list[str]:
    """A deprecation warning for each flat knob the file's `policies:` sets."""
    policies = data.get("policies") if isinstance(data, dict) else None
    if not isinstance(policies, dict):
        return []
    return [
        f"policies.{flat} is deprecated (accepted until the next release): write it as"
        f" policies.{policy}.{name}"
        for flat, (policy, name) in FLAT_POLICY_KNOBS.items()
        if flat in policies
    ]
