"""Scenarios: small declarative YAML files describing who sends what, how often, for how long.

A scenario names its tenants (each with a tier, a share of the rate, prompt and answer sizes
and a key the proxy config holds), the offered rate (absolute, or a multiple of the measured
capacity), the arrival process, optional phases (a burst) and the SLO of each tier. A scenario
may ``extends: other`` and override top-level fields. The shipped ones live in
``proxy/bench/scenarios/``; any path to a file works too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proxy.bench.stats import Slo

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArrivalSpec(_Strict):
    process: Literal["poisson", "gamma"] = "poisson"
    # Coefficient of variation of the gaps between requests (gamma only; 1 is Poisson).
    cv: float = Field(1.0, gt=0)

    @property
    def effective_cv(self) -> float:
        return 1.0 if self.process == "poisson" else self.cv


class Phase(_Strict):
    duration_s: float = Field(gt=0)
    factor: float = Field(1.0, ge=0)  # multiplies the scenario's rate during this phase


class TenantLoad(_Strict):
    name: str = Field(min_length=1)
    tier: str = Field(min_length=1)
    share: float = Field(1.0, gt=0)  # relative share of the scenario's rate
    key: str | None = None  # API key; default bench-<name>-key
    kind: Literal["chat", "document"] = "chat"
    prompt_words: tuple[int, int] = (8, 48)  # inclusive range, drawn uniformly
    max_tokens: tuple[int, int] = (16, 64)  # inclusive range; sent with ignore_eos
    arrival: ArrivalSpec | None = None  # overrides the scenario's arrival process

    @model_validator(mode="after")
    def _ranges(self) -> TenantLoad:
        for field in ("prompt_words", "max_tokens"):
            lo, hi = getattr(self, field)
            if not 1 <= lo <= hi:
                raise ValueError(f"{field} must be [low, high] with 1 <= low <= high")
        return self

    @property
    def api_key(self) -> str:
        return self.key or f"bench-{self.name}-key"


class SloSpec(_Strict):
    ttft_s: float = Field(gt=0)
    e2e_s: float | None = Field(None, gt=0)
    itl_s: float | None = Field(None, gt=0)  # mean gap between tokens after the first
    percentile: float = Field(99.0, gt=0, lt=100)  # of the proxy's target (docs/slo.md)

    def to_slo(self) -> Slo:
        return Slo(ttft_s=self.ttft_s, e2e_s=self.e2e_s, itl_s=self.itl_s)

    def proxy_slo(self) -> dict[str, float]:
        """The tier's ``slo:`` in the proxy config: the same numbers the bench judges by."""
        out = {"ttft_s": self.ttft_s, "percentile": self.percentile}
        if self.itl_s is not None:
            out["itl_s"] = self.itl_s
        return out


class Scenario(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    duration_s: float = Field(60.0, gt=0)
    load: float | None = Field(None, gt=0)  # multiple of the measured capacity
    rate_rps: float | None = Field(None, gt=0)  # or an absolute rate
    arrival: ArrivalSpec = ArrivalSpec()
    phases: list[Phase] = Field(default_factory=list)
    slo: dict[str, SloSpec] = Field(default_factory=dict)
    tenants: list[TenantLoad] = Field(min_length=1)
    # Tier settings for the proxy config that `tierproxy bench` writes (proxy.config.schema.Tier
    # fields); the bench defaults apply when absent.
    proxy_tiers: dict[str, dict[str, Any]] | None = None
    max_requests: int = Field(20_000, gt=0)

    @model_validator(mode="after")
    def _checks(self) -> Scenario:
        if self.load is not None and self.rate_rps is not None:
            raise ValueError("give load (x capacity) or rate_rps, not both")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("a tenant name appears twice")
        keys = [t.api_key for t in self.tenants]
        if len(set(keys)) != len(keys):
            raise ValueError("two tenants share a key")
        for tier in self.slo:
            if tier not in self.tiers:
                raise ValueError(f"slo names tier {tier!r}, which no tenant is in")
        return self

    @property
    def tiers(self) -> list[str]:
        """Tier names in first-seen order."""
        return list(dict.fromkeys(t.tier for t in self.tenants))

    @property
    def relative(self) -> bool:
        """The rate is a multiple of the capacity (the default when no rate is given)."""
        return self.rate_rps is None

    @property
    def load_factor(self) -> float:
        return self.load if self.load is not None else 1.0

    def timeline(self, duration_s: float | None = None) -> list[Phase]:
        """The phases, scaled to ``duration_s`` when given; one flat phase when none declared."""
        phases = self.phases or [Phase(duration_s=self.duration_s, factor=1.0)]
        total = sum(p.duration_s for p in phases)
        if duration_s is None or duration_s == total:
            return list(phases)
        scale = duration_s / total
        return [Phase(duration_s=p.duration_s * scale, factor=p.factor) for p in phases]

    def total_duration(self, duration_s: float | None = None) -> float:
        return sum(p.duration_s for p in self.timeline(duration_s))

    def peers(self) -> dict[str, str]:
        """Tenant -> its group of equal demand (same tier, hence same weight, and the same
        offered load: share, sizes, arrival process), named after the group's first tenant.
        Tenants of one group should see the same latency from a fair proxy."""
        first: dict[str, str] = {}
        out: dict[str, str] = {}
        for t in self.tenants:
            demand = t.model_dump_json(exclude={"name", "key"})
            out[t.name] = first.setdefault(demand, t.name)
        return out

    def slo_for(self, tier: str) -> Slo | None:
        spec = self.slo.get(tier)
        return spec.to_slo() if spec is not None else None


class ScenarioError(Exception):
    pass


def available_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def _path_for(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return SCENARIO_DIR / f"{name_or_path}.yaml"


def _raw(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = _path_for(name_or_path)
    if str(path) in seen:
        raise ScenarioError(f"scenario {name_or_path!r} extends itself")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        known = ", ".join(available_scenarios())
        raise ScenarioError(f"no scenario {name_or_path!r} (shipped: {known})") from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a mapping")
    base = data.pop("extends", None)
    if base is None:
        return data
    parent = _raw(str(base), (*seen, str(path)))
    parent.pop("description", None)
    return {**parent, **data}


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a scenario file by path; raises ScenarioError."""
    data = _raw(name_or_path)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ScenarioError(f"scenario {name_or_path!r}: {problems}") from exc
