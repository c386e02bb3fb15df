"""Load generators people point at vLLM, unchanged, through the proxy and directly:
`vllm bench serve` (through proxy.bench.vllm_bench_shim) and GuideLLM with its defaults
(installed by `make compat-tools` into a venv of its own). Each runs a few seconds per side."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers.compat import MODEL, TOKENIZER_DIR, Sides
from tests.helpers.engines import LONG_CONTEXT
from tests.helpers.paths import REPO

# long: GuideLLM and vLLM import torch in each client process (~30 s each on 2 cores).
pytestmark = [pytest.mark.integration, pytest.mark.engines(LONG_CONTEXT), pytest.mark.long]
TOOLS_BIN = REPO / ".tierproxy" / "tools-venv" / "bin"
PROMPTS = 8
INPUT_LEN = 32
OUTPUT_LEN = 16
# `vllm bench serve` twice in one interpreter: importing vLLM is most of its run time.
VLLM_BENCH_TWICE = """
import sys
from proxy.bench.vllm_bench_shim import main
proxy, direct, *args = sys.argv[1:]  # main() replaces sys.argv
for side, url in (("proxy", proxy), ("direct", direct)):
    main([*args, "--base-url", url, "--result-filename", side + ".json"])
"""


async def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> str:
    """Run a client to its end without blocking the proxy in this event loop."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{cmd[0]} exited {proc.returncode}:\n{text[-4000:]}"
    return text


async def test_vllm_bench_serve_same_results(both: Sides, tmp_path: Path) -> None:
    args = [
        *("bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--model", MODEL, "--tokenizer", str(TOKENIZER_DIR), "--dataset-name", "random"),
        *("--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN)),
        *("--num-prompts", str(PROMPTS), "--request-rate", "inf", "--ignore-eos"),
        *("--temperature", "0", "--seed", "1", "--disable-tqdm"),
        *("--save-result", "--save-detailed", "--result-dir", str(tmp_path)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENAI_API_KEY": both.key}
    cmd = [sys.executable, "-c", VLLM_BENCH_TWICE, both.proxy, both.direct, *args]
    out = await _run(cmd, env, timeout_s=240)
    results = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in ("proxy", "direct")}
    for side, result in results.items():
        assert result["completed"] == PROMPTS and result["failed"] == 0, (side, result["errors"])
        assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS, side
    proxy, direct = results["proxy"], results["direct"]
    for key in ("total_input_tokens", "total_output_tokens", "input_lens", "output_lens"):
        assert proxy[key] == direct[key], key
    # vllm bench aligns prompts through /tokenize WITHOUT the API key: direct vLLM (whose
    # --api-key guards /v1 only) answers it, the proxy (a key on every model route) says 401,
    # so the proxy side skips the alignment; with the key the route answers the same.
    assert out.count("/tokenize unavailable") == 1
    body = {"model": MODEL, "prompt": "hello there", "add_special_tokens": False}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(both.proxy + "/tokenize", json=body) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        bearer = {"Authorization": f"Bearer {both.key}"}
        async with session.post(both.proxy + "/tokenize", json=body, headers=bearer) as r:
            through = await r.json()
        async with session.post(both.direct + "/tokenize", json=body) as r:
            assert (await r.json())["tokens"] == through["tokens"]


def _guidellm_report(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def _requests_of(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Successful, errored and incomplete requests of the report's one benchmark."""
    (benchmark,) = report["benchmarks"]
    requests: dict[str, list[dict[str, Any]]] = benchmark["requests"]
    return requests


async def test_guidellm_defaults_same_results(both: Sides, tmp_path: Path) -> None:
    guidellm = TOOLS_BIN / "guidellm"
    if not guidellm.exists():
        pytest.fail("GuideLLM is not installed: run `make compat-tools` (make test does)")
    reports = {}
    for side, url, key in reversed(both.pairs()):  # vLLM first: its result stands alone
        url = url.removesuffix("/v1")
        backend = {"kind": "openai_http", "target": url, "model": MODEL, "api_key": key}
        output = tmp_path / f"{side}.json"
        cmd = [
            str(guidellm),
            *("run", "--backend", json.dumps(backend)),
            *("--profile", "kind=constant,rate=4"),
            # A count, not a duration: on a busy host a 3 s run once ended before any answer.
            *("--constraint", "kind=max_requests,count=12"),
            *("--tokenizer", f"kind=hf_auto,model={TOKENIZER_DIR}"),
            *(
                "--data",
                f"kind=synthetic_text,prompt_tokens={INPUT_LEN},output_tokens={OUTPUT_LEN}",
            ),
            *("--output", f"kind=json,path={output}", "--disable-console-interactive"),
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "ERROR"}
        await _run(cmd, env, timeout_s=180)
        reports[side] = _guidellm_report(output)
    for side, report in reports.items():
        requests = _requests_of(report)
        assert requests["successful"], side
        assert requests["errored"] == [], (side, requests["errored"][:1])
    per_side = {
        side: {(r["prompt_tokens"], r["output_tokens"]) for r in _requests_of(report)["successful"]}
        for side, report in reports.items()
    }
    assert per_side["proxy"] == per_side["direct"]
