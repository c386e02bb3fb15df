"""Where the repository is, for tests that read its files (configs, docs, compose, dashboards),
and where the tiny model lives."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / ".tierproxy" / "tiny-model"  # made by `make model` or on first use
