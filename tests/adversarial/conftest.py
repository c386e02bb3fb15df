"""The standing adversarial suite: hostile clients, faulty backends, forged tickets; the
fuzzes' status histograms in pytest's terminal summary (the clock fixture: tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.helpers.fuzz_histogram import FUZZ, SERVED_FUZZ


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for histogram in (FUZZ, SERVED_FUZZ):
        if not histogram.cases():
            continue
        terminalreporter.section(f"{histogram.title} status histogram")
        terminalreporter.write_line(histogram.summary())
        for kind, counts in sorted(histogram.by_kind.items()):
            line = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
            terminalreporter.write_line(f"  {kind}: {line}")
        terminalreporter.write_line(f"written to {histogram.path}")
