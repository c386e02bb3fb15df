"""Which body fields go on to vLLM, per route: deny by default (docs/isolation.md).

vLLM 0.32's request models are the reference. A field vLLM keeps beyond the request, echoes
into engine-wide state or takes as an identity has a rule here: dropped (``session_id`` is
copied into every KV event, and the publisher keeps 10,000 batches; ``priority``,
``vllm_xargs``, ``cache_salt`` and the connectors' ``*_transfer_params`` steer the engine,
which only the signed ticket decides), set by the proxy (``request_id``: vLLM's own request id
on /v1/responses), or bounded (``user``, ``metadata``: OpenAI's own limits). Known fields with
unbounded content that vLLM uses only inside the request (messages, prompt, tools ...) pass:
the prompt's bound measures them (proxy.request.prompt_bound). A field vLLM does not know
passes only as a small scalar; anything else is refused with a 400 naming it, never passed on
unbounded nor dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.api.errors import bad_request

# drop: never sent on; proxy_id: replaced by the proxy's request id (proxy.request.upstream);
# user / metadata: bounded as OpenAI bounds them, 400 past it; unmetered: 400 when set (true).
Rule = Literal["drop", "proxy_id", "user", "metadata", "unmetered"]

MAX_USER_CHARS = 256
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# An unknown field passes when it is a bool, a number or a string of at most this many chars.
MAX_UNKNOWN_STRING_CHARS = 256

ENGINE_FIELDS: Mapping[str, Rule] = {
    "session_id": "drop",
    "priority": "drop",
    "vllm_xargs": "drop",
    "cache_salt": "drop",  # the proxy sets the tenant's own (proxy.request.upstream)
    "kv_transfer_params": "drop",
    "ec_transfer_params": "drop",
    "request_id": "proxy_id",
    "user": "user",
    "metadata": "metadata",
    # vLLM's beam search sends the engine a request per beam per token, each with the prompt and
    # the output so far, and reports the prompt once: fresh eyes, 2026-12-06, billed 25 prompt
    # tokens for 59,625 run (36,073 not cached). Its work is not what its usage says.
    "use_beam_search": "unmetered",
    # vLLM holds a stream's tokens back until this many are made (the first and last chunk
    # aside): a stream cut in between is billed what it delivered, while the engine decoded up
    # to the interval more (red team, 2026-12-06: 38,663 tokens run on a 6,000 quota, billed
    # 3,864). The text is the same at any interval: sent as vLLM's default, one step a chunk.
    "stream_interval": "drop",
}

# Fields of vLLM 0.32's request models (and OpenAI's of the same routes), by group.
_COMMON = frozenset(
    {"model", "user", "metadata", "request_id", "priority", "cache_salt", "session_id",
     "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "mm_processor_kwargs",
     "media_io_kwargs", "truncate_prompt_tokens", "add_special_tokens"}
)  # fmt: skip
_SAMPLING = frozenset(
    {"stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "best_of",
     "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
     "repetition_penalty", "length_penalty", "use_beam_search", "seed", "stop",
     "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "logprobs",
     "top_logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
     "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
     "return_tokens_as_token_ids", "return_token_ids", "response_format",
     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
     "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
     "thinking_token_budget", "echo", "service_tier", "store", "reasoning_effort",
     "include_reasoning", "prediction", "modalities", "audio", "web_search_options",
     "parallel_tool_calls", "logprob_token_ids", "repetition_detection", "return_mm_kwargs",
     "return_token_offsets", "routed_experts_prompt_start", "stream_interval",
     "truncation_side", "watermarking", "mm_payload"}
)  # fmt: skip
_CHAT_TEMPLATE = frozenset(
    {"messages", "tools", "tool_choice", "functions", "function_call", "documents",
     "chat_template", "chat_template_kwargs", "add_generation_prompt",
     "continue_final_message", "return_token_strs", "return_prompt_text"}
)  # fmt: skip
_POOLING = frozenset(
    {"input", "encoding_format", "dimensions", "normalize", "embed_dtype", "endianness",
     "softmax", "activation", "use_activation", "task", "pooling_task", "return_documents",
     "top_n", "data", "padding", "truncation_side"}
)  # fmt: skip

CHAT = _COMMON | _SAMPLING | _CHAT_TEMPLATE
COMPLETIONS = _COMMON | _SAMPLING | {"prompt", "suffix", "prompt_embeds"}
RESPONSES = (
    _COMMON
    | _SAMPLING
    | {"input", "instructions", "max_output_tokens", "max_tool_calls", "previous_response_id",
       "prompt", "reasoning", "text", "tool_choice", "tools", "truncation", "include",
       "background", "conversation", "prompt_cache_key", "safety_identifier",
       "enable_response_messages", "previous_input_messages", "chat_template_kwargs"}
)  # fmt: skip
POOLED = _COMMON | _POOLING | _CHAT_TEMPLATE
SCORE = (
    _COMMON
    | _POOLING
    | {"text_1", "text_2", "data_1", "data_2", "queries", "documents", "items", "query",
       "chat_template", "chat_template_kwargs", "instruction", "max_tokens_per_doc",
       "max_tokens_per_query"}
)  # fmt: skip
TOKENIZE = _COMMON | _CHAT_TEMPLATE | {"prompt", "return_token_strs"}
DETOKENIZE = _COMMON | {"tokens"}


@dataclass(frozen=True)
class BodyFields:
    """A route's fields: those vLLM knows, and the rule of each that needs one."""

    known: frozenset[str]
    rules: Mapping[str, Rule] = field(default_factory=lambda: ENGINE_FIELDS)

    def apply(self, body: dict[str, Any]) -> None:
        """The body as it may go on (in place); 400 naming the first field that may not."""
        for name in list(body):
            rule = self.rules.get(name)
            if rule is not None:
                _apply_rule(body, name, rule)
            elif name not in self.known and not _small_scalar(body[name]):
                raise bad_request(
                    f"Unknown field '{name}': only a boolean, a number or a string of at most"
                    f" {MAX_UNKNOWN_STRING_CHARS} characters passes (docs/isolation.md)",
                    param=name,
                    code="unknown_field",
                )


def _apply_rule(body: dict[str, Any], name: str, rule: Rule) -> None:
    if rule in ("drop", "proxy_id"):
        del body[name]
    elif rule == "user":
        _check_string(body[name], name, MAX_USER_CHARS)
    elif rule == "unmetered":
        if body[name]:
            raise bad_request(
                f"'{name}' is not offered here: the engine work it makes is not what its usage"
                " reports, so it cannot be billed (docs/quotas.md)",
                param=name,
                code="unmetered_field",
            )
    else:
        _check_metadata(body[name], name)


def _small_scalar(value: object) -> bool:
    if isinstance(value, bool | int | float):
        return True
    return isinstance(value, str) and len(value) <= MAX_UNKNOWN_STRING_CHARS


def _check_string(value: object, name: str, limit: int) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise bad_request(f"'{name}' must be a string of at most {limit} characters", param=name)


def _check_metadata(value: object, name: str) -> None:
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise bad_request(
            f"'{name}' must be an object of at most {MAX_METADATA_KEYS} keys", param=name
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"'{name}' keys are at most {MAX_METADATA_KEY_CHARS} characters", param=name
            )
        _check_string(item, f"{name}.{key}", MAX_METADATA_VALUE_CHARS)
