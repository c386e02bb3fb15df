"""A fresh CPU engine with LoRA on, as `tierproxy up` starts one for `adapters:`
(proxy.tools.tiny_adapters.lora_engine_settings), answers a base-model request sent before any
adapter request, and goes on answering (red team E1, 2026-12-03: in bfloat16 its attention
took AMX tiles on this host and the first base-model batch killed vLLM's worker with SIGILL;
every later request was a 500). Its own engine: the first batch must be this test's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from proxy.bench.inproc import SECRET
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import EngineProcess, local_engine
from proxy.tools.tiny_adapters import lora_engine_settings

pytestmark = [pytest.mark.integration, pytest.mark.long]


def _complete(url: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_base_model_request_first_leaves_a_fresh_lora_engine_serving(tmp_path: Path) -> None:
    args, env = lora_engine_settings(2, True, True)
    env = {**env, DEFAULT_SECRET_ENV: SECRET.decode()}  # the plugin's, as `tierproxy up` sets
    engine = EngineProcess(local_engine(extra_args=args, env=env), tmp_path / "vllm.log")
    engine.start()
    try:
        engine.wait_ready(600.0)
        assert [_complete(engine.spec.url) for _ in range(3)] == [200, 200, 200]
    finally:
        engine.stop()
