"""A route's prompt for the prefix-cache index (proxy.request.prompt_blocks): what the local
tokenizer renders, and what a backend's ``POST /tokenize`` is asked (proxy.request.remote_tokens).
None wherever the proxy cannot be sure to see the very tokens vLLM will: no blocks, the request
is placed by load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.policies.blockhash import token_ids_ok


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, str]]  # rendered by the model's chat template


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class IdsPrompt:
    ids: list[int]  # token ids the client gave: no tokenizer needed


LocalPrompt = ChatPrompt | TextPrompt | IdsPrompt


@dataclass(frozen=True)
class KvPrompt:
    """How a route's body gives its prompt: ``local`` for the proxy's tokenizer, ``remote``
    the body of a backend's /tokenize call (without ``model``)."""

    local: Callable[[dict[str, Any]], LocalPrompt | None]
    remote: Callable[[dict[str, Any]], dict[str, Any] | None]


# Body fields that change the prompt's tokens when present: such requests get no local blocks.
_CHAT_FIELDS = frozenset(
    {
        "tools",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "truncate_prompt_tokens",
        "mm_processor_kwargs",
    }
)
_COMPLETION_FIELDS = frozenset({"add_special_tokens", "truncate_prompt_tokens", "prompt_embeds"})
# What /tokenize takes of a chat request that changes its tokens; anything else that does
# (documents, media) is not sent this way.
_TOKENIZE_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
_NOT_RENDERED_ALIKE = frozenset({"documents", "mm_processor_kwargs", "media_io_kwargs"})


def _text_content(content: object) -> str | None:
    """A message's content as vLLM gives it to a string-content template: the text, or the
    text parts joined by newlines; None for any other part (images, audio, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not set(message) <= {"role", "content", "name"}:
            return None
        role, content = message.get("role"), _text_content(message.get("content"))
        if not isinstance(role, str) or content is None:
            return None
        rendered = {"role": role, "content": content}
        if isinstance(message.get("name"), str):
            rendered["name"] = message["name"]
        out.append(rendered)
    return out


def chat_local(body: dict[str, Any]) -> LocalPrompt | None:
    if _CHAT_FIELDS & body.keys():
        return None
    messages = chat_messages(body)
    return ChatPrompt(messages) if messages is not None else None


def given_ids(body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids: used as they are, no tokenizer needed."""
    prompt = body.get("prompt")
    if _COMPLETION_FIELDS & body.keys():
        return None
    return prompt if prompt and token_ids_ok(prompt) else None


def completion_local(body: dict[str, Any]) -> LocalPrompt | None:
    if _COMPLETION_FIELDS & body.keys():
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    ids = given_ids(body)
    return IdsPrompt(ids) if ids is not None else None


def _text_only(messages: list[Any]) -> bool:
    """No part other than text (images and audio hash their own extra keys)."""
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if isinstance(content, list) and any(
            not isinstance(p, dict) or p.get("type") != "text" for p in content
        ):
            return False
    return True


def chat_remote(body: dict[str, Any]) -> dict[str, Any] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or _NOT_RENDERED_ALIKE & body.keys():
        return None
    if not _text_only(messages):
        return None
    return {"messages": messages, **{k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}}


def completion_remote(body: dict[str, Any]) -> dict[str, Any] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or {"truncate_prompt_tokens", "prompt_embeds"} & body.keys():
        return None
    out: dict[str, Any] = {"prompt": prompt}
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


CHAT = KvPrompt(local=chat_local, remote=chat_remote)
COMPLETION = KvPrompt(local=completion_local, remote=completion_remote)
