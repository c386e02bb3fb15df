"""Where the repository is, for tests that read its files (configs, docs, compose, dashboards)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
