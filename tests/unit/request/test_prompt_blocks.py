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

from proxy.bench.inproc import make_config
from proxy.config.loader import parse_config
from proxy.config.schema import Config
from proxy.policies.blockhash import chain_hashes
from proxy.request import prompt_blocks as prompt_blocks_module
from proxy.request.inbound import ParsedRequest
from proxy.request.prompt_blocks import (
    ModelTokenizer,
    PastContext,
    PromptBlocks,
    prompt_block_hashes,
    prompt_tokens,
)
from tests.helpers.paths import TINY_MODEL_DIR as MODEL  # made by `make model`


@pytest.fixture(scope="module")
def model() -> ModelTokenizer:
    return ModelTokenizer(MODEL)


def parsed(body: dict[str, Any], endpoint: str = "chat", estimate: int = 10) -> ParsedRequest:
    request = ParsedRequest(body, endpoint, False, "tiny", estimate, 16, 16, False)  # type: ignore[arg-type]
    request.held_bytes = 4 * estimate  # what decides inline or on a thread
    return request


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
    inline = _config(enabled=True, tokenizer=str(MODEL), inline_bytes=100_000)
    assert await blocks.compute(inline, request, "salt") == want
    threaded = _config(enabled=True, tokenizer=str(MODEL), inline_bytes=0)
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
    threaded = _config(enabled=True, tokenizer=str(MODEL), inline_bytes=0)
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


def test_a_template_broken_for_every_chat_leaves_the_tokenizer_for_completions(
    tmp_path: Path,
) -> None:
    """Fresh eyes round seven F1: a template that raised TypeError on a plain chat stopped
    `tierproxy serve` from starting (the warm-up), and its failed load was kept for good."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((MODEL / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% if tools|length > 0 %}x{% endif %}")
    model = prompt_blocks_module.load_model(str(tmp_path))
    assert model is not None and model.template is None  # chats: no blocks; completions: yes
    assert prompt_tokens(model, chat({"role": "user", "content": "hi"})) is None
    completion = parsed({"model": "tiny", "prompt": "hello"}, "completions")
    assert prompt_tokens(model, completion)


async def test_a_load_that_raised_is_unusable_and_retried_on_the_next_preload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(directory: str) -> ModelTokenizer | None:
        raise TypeError("a bug in loading")

    monkeypatch.setattr(prompt_blocks_module, "load_model", broken)
    config, blocks = _config(enabled=True, tokenizer=str(MODEL)), PromptBlocks()
    blocks.preload(config)  # logged by the future's owner, never raised into the server
    assert await blocks.compute(config, chat({"role": "user", "content": "hi"}), "s") is None
    monkeypatch.setattr(prompt_blocks_module, "load_model", lambda d: ModelTokenizer(Path(d)))
    blocks.preload(config)
    assert await blocks.compute(config, chat({"role": "user", "content": "hi"}), "s") is not None


async def test_a_prompt_no_thread_takes_in_time_goes_without_blocks_and_never_runs() -> None:
    """Round seven F2: better tiers' prompts go first; a worse tier's waited for a thread for
    as long as they kept coming (14 s, past its timeouts). It waits ``start_within_s``."""
    blocks, gate, ran = PromptBlocks(), threading.Event(), list[str]()
    busy = [
        asyncio.create_task(blocks._on_thread(name, lambda: (1,) if gate.wait(10) else None))
        for name in ("a", "b")
    ]  # both threads taken
    while blocks._threads.waiting or len(blocks.off_loop.held) < 2:
        await asyncio.sleep(0.01)

    def never() -> tuple[int, ...]:
        ran.append("c")
        return (2,)

    late = await blocks._on_thread("c", never, 5, 0.05)
    await asyncio.sleep(0)  # the share comes back through the loop
    assert late is None and blocks.off_loop.of("c") == 0
    gate.set()
    assert [await task for task in busy] == [(1,), (1,)]
    assert ran == [] and blocks._threads.waiting == 0


async def test_a_tenant_whose_client_left_keeps_its_thread_share_until_the_work_ends() -> None:
    """Round seven F3: the share came back when the client left while its prompt was still
    being tokenized, so a tenant that sent and left took both threads."""
    blocks, gate = PromptBlocks(), threading.Event()
    task = asyncio.create_task(blocks._on_thread("a", lambda: (1,) if gate.wait(10) else None))
    while not blocks.off_loop.held or blocks._threads.waiting:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert blocks.off_loop.of("a") == 1  # its work still runs
    assert await blocks._on_thread("a", lambda: (2,)) is None
    gate.set()
    while blocks.off_loop.of("a"):
        await asyncio.sleep(0.01)
    assert await blocks._on_thread("a", lambda: (2,)) == (2,)


async def test_prompts_past_max_prompt_tokens_get_no_blocks() -> None:
    config = _config(enabled=True, tokenizer=str(MODEL), max_prompt_tokens=50)
    blocks, text = (
        PromptBlocks(),
        {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}]},
    )
    assert await blocks.compute(config, parsed(text, estimate=50), "s")
    assert await blocks.compute(config, parsed(text, estimate=51), "s") is None


async def test_a_prompt_past_the_models_context_is_not_hashed(model: ModelTokenizer) -> None:
    # vLLM refuses it (400, no engine work): nothing for the chooser to remember.
    fits, too_long = (parsed({"prompt": list(range(n))}, "completions") for n in (2047, 2048))
    blocks = PromptBlocks()
    config = _config(enabled=True, tokenizer=str(MODEL), inline_bytes=100_000)
    # Said as such: the pipeline refuses it with vLLM's 400 before it takes a backend's slot
    # (a burst of them moved other tenants' turns: red team).
    assert await blocks.compute(config, fits, "s", context=2048)
    with pytest.raises(PastContext):
        await blocks.compute(config, too_long, "s", context=2048)
    assert await blocks.compute(config, too_long, "s") is not None  # context unknown: hashed
    with pytest.raises(PastContext):
        prompt_block_hashes(model, too_long, 32, "s", context=2048)
    given = _config(enabled=True, inline_bytes=100_000)  # token ids, no tokenizer
    with pytest.raises(PastContext):
        await blocks.compute(given, too_long, "s", context=2048)
    small = _config(enabled=True, tokenizer=str(MODEL), inline_bytes=10)  # on a thread
    with pytest.raises(PastContext):
        await blocks.compute(small, too_long, "s", context=2048)
