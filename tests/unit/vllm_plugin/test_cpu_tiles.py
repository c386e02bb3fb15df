"""The plugin asks Linux for the AMX tile permission in every vLLM process (proxy.vllm_plugin.
cpu_tiles): each case in a fresh interpreter, which starts without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.vllm_plugin.cpu_tiles import _on_linux_x86_64


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _fresh(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


@pytest.mark.skipif(not _cpu_has_amx(), reason="no AMX on this CPU")
def test_register_leaves_the_process_allowed_amx_tiles() -> None:
    code = (
        "from proxy.vllm_plugin.cpu_tiles import amx_tiles_allowed\n"
        "before = amx_tiles_allowed()\n"
        "from proxy.vllm_plugin import register\n"
        "register()\n"
        "print(before, amx_tiles_allowed())"
    )
    assert _fresh(code) == "False True"


def test_asking_where_there_is_no_amx_is_harmless() -> None:
    code = "from proxy.vllm_plugin.cpu_tiles import allow_amx_tiles\nprint(allow_amx_tiles())"
    expected = _on_linux_x86_64() and _cpu_has_amx()
    assert _fresh(code) == str(expected)
