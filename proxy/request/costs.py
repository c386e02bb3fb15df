"""What a request's input costs, per route, in characters of text (the tier's chars_per_token
turns them into a token estimate for fairness and the tokens-per-minute limit: a guess; what
quotas reserve is proxy.request.prompt_bound's bound); and the few coercions vLLM's pydantic
models make, so the proxy accepts what vLLM accepts.

The estimate is charged up front and corrected once the backend reports its usage.
"""

from __future__ import annotations

from typing import Any

from proxy.api.errors import bad_request
from proxy.api.usage import token_usage

# Message parts whose size says nothing about their tokens (an image's base64 is not its token
# count): left out of the estimate (never of the bound); the usage corrects it.
MEDIA_KEYS = frozenset(
    {"image_url", "input_audio", "audio_url", "video_url", "file", "input_image", "file_data"}
)
SCALAR_CHARS = 4  # a number, a token id or a literal: about one token


def text_chars(value: object, *, keys: bool = False) -> int:
    """Characters of text in a prompt, message or schema, however nested (iteratively: a
    client's nesting never meets Python's recursion limit); ``keys`` counts object keys too."""
    chars = 0
    stack: list[Any] = [value]  # Any: narrowed by exact type() checks below
    while stack:
        item = stack.pop()
        kind = type(item)  # orjson makes exact types: no ABC or subclass checks needed
        if kind is str:
            chars += len(item)
        elif kind is list:
            # Scalars counted here rather than pushed: a list of a million token ids is one
            # loop, not a million trips through the stack.
            for child in item:
                sort = type(child)
                if sort is str:
                    chars += len(child)
                elif sort is list or sort is dict:
                    stack.append(child)
                elif child is not None:
                    chars += SCALAR_CHARS
        elif kind is dict:
            for key, child in item.items():
                if key in MEDIA_KEYS:
                    continue
                if keys:
                    chars += len(key)
                stack.append(child)
        elif item is not None:
            chars += SCALAR_CHARS
    return chars


# What a chat prompt holds besides its messages: the schemas the backend renders into it, and
# what its chat template renders (vLLM's ``documents`` for RAG, ``chat_template_kwargs``).
_SCHEMA_FIELDS = (
    "tools",
    "functions",
    "response_format",
    "tool_choice",
    "documents",
    "chat_template_kwargs",
)


def _validate_messages(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages.[{i}]"
            )
        # Every part: content, name, tool calls and their arguments, tool results.
        chars += text_chars(message) + 8
    return chars


def _validate_prompt(prompt: object) -> int:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_int(p) for p in prompt)
            or all(isinstance(p, list) and all(_is_int(x) for x in p) for p in prompt)
        )
    )
    if not ok:
        raise bad_request(
            "'prompt' must be a string, an array of strings or an array of token ids",
            param="prompt",
        )
    return text_chars(prompt)


def chat_chars(body: dict[str, Any]) -> int:
    """The messages (validated) and the schemas rendered with them."""
    chars = _validate_messages(body.get("messages"))
    return chars + sum(text_chars(body.get(name), keys=True) for name in _SCHEMA_FIELDS)


def completion_chars(body: dict[str, Any]) -> int:
    if "prompt" not in body:
        raise bad_request("'prompt' is required", param="prompt")
    return _validate_prompt(body["prompt"])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _required(body: dict[str, Any], *names: str) -> object:
    """The first of ``names`` present; 400 naming them all when none is."""
    for name in names:
        if name in body:
            return body[name]
    listed = " or ".join(f"'{n}'" for n in names)
    raise bad_request(f"{listed} is required", param=names[0])


def _items(value: object) -> int:
    """How many inputs a score/rerank side holds (a string or one object is one)."""
    return len(value) if isinstance(value, list) and value else 1


def _pairs_chars(left: object, right: object) -> int:
    """Score and rerank run the model on every pair: one left item meets every right one."""
    if _items(left) == 1:
        return text_chars(left) * _items(right) + text_chars(right)
    return text_chars(left) + text_chars(right)


def responses_chars(body: dict[str, Any]) -> int:
    """``input`` (a string or items), ``instructions`` and the schemas rendered into the
    prompt (tools, the text format)."""
    source = _required(body, "input")
    chars = text_chars(source) + text_chars(body.get("instructions"))
    return chars + sum(text_chars(body.get(name), keys=True) for name in ("tools", "text"))


def pooled_input_chars(body: dict[str, Any]) -> int:
    """Embeddings, pooling and classify: ``input`` (text, texts or token ids) or chat
    ``messages``."""
    return text_chars(_required(body, "input", "messages"))


def score_chars(body: dict[str, Any]) -> int:
    for left, right in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items")):
        if left in body and right in body:
            return _pairs_chars(body[left], body[right])
    return _pairs_chars(_required(body, "data_1", "text_1", "queries"), _required(body, "data_2"))


def rerank_chars(body: dict[str, Any]) -> int:
    return _pairs_chars(_required(body, "query"), _required(body, "documents"))


def tokenize_chars(body: dict[str, Any]) -> int:
    return text_chars(_required(body, "prompt", "messages"))


def detokenize_chars(body: dict[str, Any]) -> int:
    return text_chars(_required(body, "tokens"))


# -- coercions as pydantic's lax mode makes them (vLLM's request models) ---------------------

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_int(value: object) -> int | None:
    """``value`` as pydantic reads an int field: ints, bools, integral floats and strings of
    those ("4", " 4 ", "4.0"); None when it would refuse it."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
        return int(number) if number.is_integer() and "e" not in text.lower() else None
    return None


def lax_bool(value: object) -> bool | None:
    """``value`` as pydantic reads a bool field: bools, 0/1 and words like "true" or "no"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    return None


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int] | None:
    """(input, output) tokens of a backend's usage (``proxy.api.usage.token_usage``)."""
    counts = token_usage(usage)
    return None if counts is None else (counts.prompt, counts.completion)
