"""The prompt-prefix hash: same leading tokens, same hash; what comes after does not count."""

from __future__ import annotations

from typing import Any

from proxy.policies.prefix import prefix_hash


def _h(body: dict[str, Any], tokens: int = 8) -> int | None:
    return prefix_hash(body, tokens=tokens, chars_per_token=4.0)  # 32 characters


def _chat(*contents: Any) -> dict[str, Any]:
    roles = ["system"] + ["user"] * (len(contents) - 1)
    return {
        "model": "m",
        "messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)],
    }


def test_chat_prefix_ignores_what_comes_after_the_first_tokens() -> None:
    system = "You are a careful assistant for the billing team."  # longer than 32 characters
    assert _h(_chat(system, "question one")) == _h(_chat(system, "another question"))
    assert _h(_chat(system, "q")) != _h(_chat("You are a careless assistant.", "q"))
    assert _h(_chat("short", "x")) != _h(_chat("short", "y"))  # the prefix reaches the user turn
    assert _h(_chat("ab", "c")) != _h(_chat("a", "bc"))  # message boundaries count


def test_multipart_content_hashes_its_text() -> None:
    parts = [
        {"type": "text", "text": "hello there"},
        {"type": "image_url", "image_url": {"url": "x"}},
    ]
    assert _h(_chat(parts)) == _h(_chat("hello there"))


def test_completion_prompts_text_batch_and_token_ids() -> None:
    text = "Translate the following paragraph into French: "
    assert _h({"prompt": text + "a"}) == _h({"prompt": text + "b"})
    assert _h({"prompt": [text + "a", "other"]}) == _h({"prompt": text})
    ids = list(range(100))
    assert _h({"prompt": ids}) == _h({"prompt": [*ids[:8], 999]})
    assert _h({"prompt": ids}) != _h({"prompt": [1, *ids]})
    assert _h({"prompt": [ids, [5]]}) == _h({"prompt": ids})


def test_no_prompt_no_hash() -> None:
    assert _h({"model": "m"}) is None
    assert _h({"prompt": ""}) is None
    assert _h({"messages": []}) is None


def test_the_prefix_length_is_configurable() -> None:
    a, b = {"prompt": "x" * 40 + "a"}, {"prompt": "x" * 40 + "b"}
    assert _h(a, tokens=8) == _h(b, tokens=8)
    assert _h(a, tokens=16) != _h(b, tokens=16)
