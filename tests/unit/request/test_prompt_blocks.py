"""A prompt's blocks on the proxy's side (proxy.request.prompt_blocks) with the tiny model's
tokenizer and chat template: what is computed, what is refused (None, never a guess), and that
nothing is computed while kv_cache is off. Exactness against vLLM itself:
tests/integration/test_kvindex_vllm.py."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loader import parse_config
from proxy.config.schema import Config
from proxy.policies.blockhash import chain_hashes
from proxy.request import prompt_blocks as prompt_blocks_module
from proxy.request.inbound import ParsedRequest
from proxy.request.prompt_blocks import (
    ModelTokenizer,
    PromptBlocks,
    prompt_block_hashes,
    prompt_tokens,
)
from tests.helpers.paths import TINY_MODEL_DIR as MODEL  # made by `make model`
from tests.helpers.proxyrun import make_config


@pytest.fixture(scope="module")
def model() -> ModelTokenizer:
    return ModelTokenizer(MODEL)


def parsed(body: dict[str, Any], endpoint: str = "chat", estimate: int = 10) -> ParsedRequest:
    return ParsedRequest(body, endpoint, False, "tiny", estimate, 16, 16, False)  # type: ignore[arg-type]


def chat(*messages: dict[str, Any], **extra: Any) -> ParsedRequest:
    return parsed({"model": "tiny", "messages": list(messages), **extra})


def test_chat_is_rendered_with_the_models_template(model: ModelTokenizer) -> None:
    tokens = prompt_tokens(model, chat({"role": "user", "content": "hello"}))
    text = "<|user|>\nhello</s>\n<|assistant|>\n"  # the tiny model's template, generation prompt
    assert tokens == model.tokenizer.encode(text, add_special_tokens=False).ids
    # Text parts are joined by newlines, as vLLM hands them to a string-content template.
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert prompt_tokens(model, chat({"role": "user", "content": parts})) == prompt_tokens(
        model, chat({"role": "user", "content": "hel\nlo"})
    )


@pytest.mark.parametrize(
    "request_",
    [
        chat({"role": "user", "content": "x"}, tools=[{"type": "function"}]),
        chat({"role": "user", "content": "x"}, chat_template_kwargs={"a": 1}),
        chat({"role": "user", "content": "x"}, add_generation_prompt=False),
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}),
        chat({"role": "assistant", "content": "x", "tool_calls": []}),
        chat({"role": "user", "content": None}),
        parsed({"messages": []}),
        parsed({"prompt": ["a", "b"]}, "completions"),
        parsed({"prompt": "a", "add_special_tokens": False}, "completions"),
        parsed({"prompt": [1, 2**70]}, "completions"),
        parsed({"input": "a"}, "responses"),
    ],
)
def test_prompts_not_surely_rendered_as_vllm_does_get_none(
    model: ModelTokenizer, request_: ParsedRequest
) -> None:
    assert prompt_tokens(model, request_) is None


def test_completions_text_and_token_ids(model: ModelTokenizer) -> None:
    text = prompt_tokens(model, parsed({"prompt": "abc def"}, "completions"))
    assert text == model.tokenizer.encode("abc def", add_special_tokens=True).ids
    assert prompt_tokens(model, parsed({"prompt": ["abc def"]}, "completions")) == text
    assert prompt_tokens(model, parsed({"prompt": [5, 6, 7]}, "completions")) == [5, 6, 7]


def test_the_last_token_is_left_out_and_the_salt_is_folded_in(model: ModelTokenizer) -> None:
    exact = parsed({"prompt": list(range(64))}, "completions")  # two blocks of 32 exactly
    blocks = prompt_block_hashes(model, exact, 32, "salt")
    assert blocks == chain_hashes(list(range(63)), 32, "salt") and len(blocks) == 1
    longer = prompt_block_hashes(model, parsed({"prompt": list(range(65))}, "completions"), 32, "")
    assert longer is not None and len(longer) == 2
    other = prompt_block_hashes(model, parsed({"prompt": list(range(65))}, "completions"), 32, "s")
    assert other is not None and not set(other) & set(longer)


def _config(**kv: Any) -> Config:
    config = make_config([{"url": "http://127.0.0.1:1"}], kv_cache=kv)
    return parse_config(yaml.safe_dump(config), "test").config


async def test_nothing_is_computed_while_kv_cache_is_off() -> None:
    request = chat({"role": "user", "content": "hello " * 50})
    off = _config(tokenizer=str(MODEL))  # enabled null and the policy is not kv_aware
    assert await PromptBlocks().compute(off, request, "salt") is None
    no_tokenizer = _config(enabled=True)
    assert await PromptBlocks().compute(no_tokenizer, request, "salt") is None


async def test_computed_when_on_inline_or_in_a_thread(
    tmp_path: Path, model: ModelTokenizer
) -> None:
    request = chat({"role": "user", "content": "hello " * 50}, estimate=100)
    want = prompt_block_hashes(model, request, 32, "salt")
    assert want
    blocks = PromptBlocks()
    inline = _config(enabled=True, tokenizer=str(MODEL), inline_tokens=1000)
    assert await blocks.compute(inline, request, "salt") == want
    threaded = _config(enabled=True, tokenizer=str(MODEL), inline_tokens=0)
    assert await blocks.compute(threaded, request, "salt") == want
    missing = _config(enabled=True, tokenizer=str(tmp_path))
    assert await blocks.compute(missing, request, "salt") is None


async def test_one_tenant_has_one_long_prompt_on_the_threads_at_a_time(
    model: ModelTokenizer,
) -> None:
    """Fresh eyes (round 3, t02): one tenant's eight 1 MB prompts took the shared threads and
    slowed every other tenant; past its share a request goes without blocks (placed by load)."""
    request = chat({"role": "user", "content": "hello " * 50}, estimate=100)
    want = prompt_block_hashes(model, request, 32, "salt")
    threaded = _config(enabled=True, tokenizer=str(MODEL), inline_tokens=0)
    blocks, gate = PromptBlocks(), threading.Event()
    held = asyncio.create_task(blocks._on_thread("a", lambda: (1,) if gate.wait(10) else None))
    await asyncio.sleep(0)  # its thread holds tenant a's share
    assert blocks.off_loop.held == {"a": 1}
    assert await blocks.compute(threaded, request, "salt", tenant="a") is None
    assert await blocks.compute(threaded, request, "salt", tenant="b") == want
    gate.set()
    assert await held == (1,) and blocks.off_loop.held == {}
    assert await blocks.compute(threaded, request, "salt", tenant="a") == want


async def test_the_first_burst_loads_the_tokenizer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's opening burst loaded it once per request, on threads fighting for the
    GIL (40-50 ms queued): every request now waits on the one load, and one that leaves while
    it waits does not cancel it for the others."""
    loads, gate = [], threading.Event()
    real = prompt_blocks_module.load_model

    def slow_load(directory: str) -> ModelTokenizer | None:
        loads.append(directory)
        gate.wait(10)
        return real(directory)

    monkeypatch.setattr(prompt_blocks_module, "load_model", slow_load)
    request = chat({"role": "user", "content": "hello " * 50}, estimate=100)
    config, blocks = _config(enabled=True, tokenizer=str(MODEL)), PromptBlocks()
    waiting = [asyncio.create_task(blocks.compute(config, request, "s")) for _ in range(5)]
    await asyncio.sleep(0)  # each is waiting on the load now
    waiting[0].cancel()  # a client that left
    gate.set()
    results = await asyncio.gather(*waiting[1:])
    assert loads == [str(MODEL)]
    assert results[0] and all(result == results[0] for result in results)
    assert waiting[0].cancelled()


def test_preload_loads_before_any_request_and_retries_what_was_unusable(
    tmp_path: Path,
) -> None:
    blocks = PromptBlocks()
    blocks.preload(_config(enabled=True, tokenizer=str(MODEL)))
    assert blocks._models[str(MODEL)].result() is not None  # loaded: no request waits
    blocks.preload(_config(tokenizer=str(tmp_path)))  # kv_cache off: nothing loaded
    assert str(tmp_path) not in blocks._models
    broken = _config(enabled=True, tokenizer=str(tmp_path))
    blocks.preload(broken)
    assert blocks._models[str(tmp_path)].result() is None  # logged, requests placed by load
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the operator fixes the files
        (tmp_path / name).write_bytes((MODEL / name).read_bytes())
    blocks.preload(broken)  # and reloads
    assert blocks._models[str(tmp_path)].result() is not None
