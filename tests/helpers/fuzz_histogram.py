"""The fuzz's answers by status, kept for pytest's terminal summary (see conftest.py) and
written to .tierproxy/test-logs/fuzz-histogram.json."""

from __future__ import annotations

import collections
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HISTOGRAM_PATH = REPO / ".tierproxy" / "test-logs" / "fuzz-histogram.json"


class FuzzHistogram:
    def __init__(self, title: str = "fuzz", path: Path = HISTOGRAM_PATH) -> None:
        self.title = title
        self.path = path
        self.by_kind: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        self.seconds = 0.0

    def record(self, kind: str, status: int) -> None:
        self.by_kind[kind][status] += 1

    def statuses(self) -> collections.Counter[int]:
        total: collections.Counter[int] = collections.Counter()
        for counts in self.by_kind.values():
            total.update(counts)
        return total

    def cases(self) -> int:
        return sum(self.statuses().values())

    def as_json(self) -> dict[str, object]:
        return {
            "cases": self.cases(),
            "seconds": round(self.seconds, 1),
            "statuses": {str(s): n for s, n in sorted(self.statuses().items())},
            "by_kind": {
                kind: {str(s): n for s, n in sorted(counts.items())}
                for kind, counts in sorted(self.by_kind.items())
            },
        }

    def summary(self) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses().items()))
        return f"{self.cases()} cases in {self.seconds:.1f}s; statuses {statuses}"

    def write(self, path: Path | None = None) -> None:
        path = path or self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")


FUZZ = FuzzHistogram("fuzz (in process)")
SERVED_FUZZ = FuzzHistogram(
    "fuzz (tierproxy serve: uvloop, C parser)", HISTOGRAM_PATH.with_name("fuzz-served.json")
)
