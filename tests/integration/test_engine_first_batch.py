"""A fresh CPU engine answers a first batch too small for oneDNN to pick AMX, and goes on
answering: a plain engine in bfloat16 (`tierproxy up`'s) sent a two-token prompt, and one with
LoRA on as `tierproxy up` starts it for `adapters:` (proxy.tools.tiny_adapters) sent a base-model
request before any adapter request. On a CPU with AMX, vLLM 0.32's attention used the tiles
without Linux's permission and the worker died of SIGILL, every later request a 500 (the LoRA
case: red team E1, 4 of 4; the plain case: twice on 2026-12-03, before the plugin's
``allow_amx_tiles``). Own engines: the first batch must be this test's."""

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


def _complete(url: str, prompt: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _first_batches(lora: bool, prompt: str, tmp_path: Path) -> list[int]:
    env = {DEFAULT_SECRET_ENV: SECRET.decode()}  # the plugin's, as `tierproxy up` sets
    args: tuple[str, ...] = ()
    if lora:
        args, lora_env = lora_engine_settings(2, True, True)
        env |= lora_env
    engine = EngineProcess(local_engine(extra_args=args, env=env), tmp_path / "vllm.log")
    engine.start()
    try:
        engine.wait_ready(600.0)
        return [_complete(engine.spec.url, prompt) for _ in range(3)]
    finally:
        engine.stop()


def test_a_two_token_prompt_first_leaves_a_fresh_bfloat16_engine_serving(tmp_path: Path) -> None:
    assert _first_batches(False, "hi", tmp_path) == [200, 200, 200]


def test_a_base_model_request_first_leaves_a_fresh_lora_engine_serving(tmp_path: Path) -> None:
    assert _first_batches(True, "hello there", tmp_path) == [200, 200, 200]
