"""results.json: every request's timings and the summaries of one bench invocation.

Written at the end of a run, read back by `tierproxy bench --report` (and by anyone who wants
to compute something else from the raw timings).
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.bench.capacity import Capacity
from proxy.bench.records import RequestRecord
from proxy.bench.runner import RunResult, Sample
from proxy.bench.scenario import Scenario


@dataclass(frozen=True)
class RunMeta:
    model: str
    seed: int
    rate_rps: float
    duration_s: float
    capacity: Capacity | None = None


def document(
    scenario: Scenario,
    meta: RunMeta,
    results: dict[str, RunResult],
    reports: dict[str, dict[str, Any]],
    comparison: dict[str, dict[str, float | None]],
) -> dict[str, Any]:
    return {
        "tool": "tierproxy bench",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "scenario": scenario.model_dump(mode="json"),
        "model": meta.model,
        "seed": meta.seed,
        "rate_rps": meta.rate_rps,
        "duration_s": meta.duration_s,
        "capacity": None if meta.capacity is None else meta.capacity.to_json(),
        "comparison": comparison,
        "runs": {
            label: {
                "report": reports[label],
                "requests": [r.to_json() for r in res.records],
                "samples": [s.to_json() for s in res.samples],
            }
            for label, res in results.items()
        },
    }


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_bytes(orjson.dumps(doc))
    return path


@dataclass(frozen=True)
class Loaded:
    scenario: Scenario
    rate_rps: float
    duration_s: float
    results: dict[str, RunResult]


def load(path: Path) -> Loaded:
    data = orjson.loads(path.read_bytes())
    duration = float(data["duration_s"])
    return Loaded(
        scenario=Scenario.model_validate(data["scenario"]),
        rate_rps=float(data["rate_rps"]),
        duration_s=duration,
        results={
            label: RunResult(
                label=label,
                base_url=run["report"]["base_url"],
                records=[RequestRecord.from_json(r) for r in run["requests"]],
                samples=[Sample(**s) for s in run["samples"]],
                planned_duration=duration,
                wall_s=float(run["report"]["wall_s"]),
            )
            for label, run in data["runs"].items()
        },
    )
