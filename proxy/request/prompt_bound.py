"""An upper bound of a prompt's tokens that no body can undercut: what quotas and budgets
reserve (docs/quotas.md, "The prompt's upper bound").

Built from what cannot lie: the body's bytes (a byte-level BPE or byte-fallback tokenizer makes
at most one token per UTF-8 byte of text, and every byte of the body may be prompt: a tool's
schema, a document, a key named ``file``), plus a template's overhead per message and per input
item (an empty string of an embeddings list still costs its special tokens), with media parts
counted at ``input.max_tokens_per_media_item`` each instead of their bytes (an image's base64
says nothing of its tokens). Token ids are covered by their bytes (each takes one at least).
Score and rerank run the model on every pair: their sides are counted once per pair.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

# What a chat template adds once (BOS, a default system prompt, the generation prompt).
TEMPLATE_TOKENS = 32
# Per message: its role's markers; per input item or pair: its special tokens.
MESSAGE_TOKENS = 8
ITEM_TOKENS = 4

# Content parts that the engine turns into media tokens, by their "type".
MEDIA_TYPES = frozenset(
    {"image_url", "input_image", "image", "image_embeds", "image_pil", "input_audio",
     "audio_url", "audio", "video_url", "video", "file", "input_file"}
)  # fmt: skip

Bound = Callable[[dict[str, Any], int, int], int]  # (body, its bytes, media cap) -> tokens


def linear_bound(body: dict[str, Any], body_bytes: int, media_cap: int) -> int:
    """Chat, completions, responses, the pooling routes, tokenize: the body's bytes, media
    parts at the cap, plus the template's overhead per message and per item."""
    messages = body.get("messages")
    items = _listed(body.get("input")) + _listed(body.get("prompt"))
    media_items, media_chars = _media(messages)
    more_items, more_chars = _media(body.get("input"))  # responses items, pooling messages
    media_items += more_items
    text_bytes = max(0, body_bytes - media_chars - more_chars)
    overhead = MESSAGE_TOKENS * _listed(messages) + ITEM_TOKENS * items
    return TEMPLATE_TOKENS + text_bytes + media_items * media_cap + overhead


def pairwise_bound(body: dict[str, Any], body_bytes: int, media_cap: int) -> int:
    """Score and rerank: each pair's two sides, their bytes as JSON, however many pairs."""
    sides = _pair_sides(body)
    if sides is None:
        return linear_bound(body, body_bytes, media_cap)
    left, right = sides
    left_bytes, right_bytes = len(orjson.dumps(left)), len(orjson.dumps(right))
    pairs = max(_items(left), _items(right))
    if _items(left) == 1:
        text = left_bytes * _items(right) + right_bytes
    else:
        text = left_bytes + right_bytes
    # Never below the bytes of the whole body: what else it holds may be rendered too.
    return max(
        TEMPLATE_TOKENS + text + ITEM_TOKENS * pairs, linear_bound(body, body_bytes, media_cap)
    )


_PAIR_FIELDS = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("query", "documents"),
)


def _pair_sides(body: dict[str, Any]) -> tuple[object, object] | None:
    for left, right in _PAIR_FIELDS:
        if left in body and right in body:
            return body[left], body[right]
    return None


def _items(value: object) -> int:
    return len(value) if isinstance(value, list) and value else 1


def _listed(value: object) -> int:
    return len(value) if isinstance(value, list) else 0


def _media(messages: object) -> tuple[int, int]:
    """(media parts, characters of their strings) in the content lists of ``messages`` (chat
    messages or Responses input items). Characters never exceed the bytes they took in the
    body, so subtracting them keeps the bound a bound."""
    if not isinstance(messages, list):
        return 0, 0
    count = chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in MEDIA_TYPES:
                count += 1
                chars += _string_chars(part)
    return count, chars


def _string_chars(value: object) -> int:
    chars = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())  # keys stay counted: never subtracted
        elif isinstance(item, list):
            stack.extend(item)
    return chars
