"""The adapters benchmark's figure (proxy.bench.adapterplots) from the results it stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from proxy.bench.adapterplots import adapter_figure


def _result(mode: str, loads: float, deferred: float) -> dict[str, Any]:
    ttfts = {tier: [0.1 * (k + 1) for k in range(8)] for tier in ("high", "normal", "low")}
    return {
        "mode": mode,
        "requests": 24,
        "adapter_loads": loads,
        "waited_in_vllm": deferred,
        "waited_over_s": 0.5,
        "output_tokens_per_s": 30.0,
        "ttft_s": {},
        "ttfts": ttfts,
    }


def test_the_figure_pools_rounds_per_mode_into_one_png(tmp_path: Path) -> None:
    results = [
        _result("least_utilised (adapter-blind)", 0, 12),
        _result("adapter-aware", 24, 0),
        _result("least_utilised (adapter-blind)", 0, 10),
        _result("adapter-aware", 20, 0),
    ]
    path = adapter_figure(results, tmp_path / "adapters.png")
    with Image.open(path) as img:
        assert img.format == "PNG"
        width, height = img.size
    assert width > 3 * height  # four panels side by side
