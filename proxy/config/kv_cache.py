"""The `kv_cache:` section: the proxy's index of what each backend holds in its prefix cache,
fed by vLLM's KV events, and the prompt's blocks computed on the proxy's side
(docs/policies.md)."""

from __future__ import annotations

from pydantic import Field

from proxy.config.base import TUNING, Strict

# Backend choosers that read the index and the prompts' blocks (``policies.backends``).
KV_AWARE_POLICIES: frozenset[str] = frozenset({"kv_aware"})


class KvCache(Strict):
    """Prefix-cache index per backend from vLLM's KV events (ZMQ), and the prompt's blocks."""

    enabled: bool | None = Field(
        None,
        description="Subscribe to each backend's KV events and compute each prompt's blocks."
        " null: exactly when `policies.backends` is `kv_aware`; true: also without it (to"
        " watch the indexes' metrics). The backends must run with `--enable-prefix-caching"
        ' --kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq",'
        ' "endpoint": "tcp://*:PORT"}\'` (`tierproxy engine` and `tierproxy up` add them).',
    )
    block_size: int = Field(
        32,
        gt=0,
        le=4096,
        description="vLLM's `--block-size`, the same on every backend (the CPU attention needs"
        " a multiple of 32). A KV event of another block size is not indexed.",
    )
    tokenizer: str | None = Field(
        None,
        description="Directory of the served model's tokenizer (`tokenizer.json`, and its chat"
        " template in `chat_template.jinja` or `tokenizer_config.json`): prompts are tokenized"
        " here as vLLM will see them. null: by a backend's `POST /tokenize` (a round trip"
        " before queueing; vLLM's own rendering), within the two bounds below.",
    )
    tokenize_timeout_s: float = Field(
        0.5,
        gt=0,
        description="Without `tokenizer`: a backend's /tokenize that has not answered by then"
        " gives no blocks (the chooser falls back to load).",
        json_schema_extra=TUNING,
    )
    max_remote_tokenize: int = Field(
        16,
        ge=0,
        description="Without `tokenizer`: /tokenize calls in flight at most (per process), a"
        " tenant at most half of them; a request past it gets no blocks rather than wait."
        " 0: never.",
        json_schema_extra=TUNING,
    )
    max_blocks: int = Field(
        200_000,
        gt=0,
        description="Blocks one backend's index holds at most (about 300 bytes each: vLLM's"
        " block hashes are ints or 32 bytes, longer ones are refused); past it"
        " the oldest stored are dropped first.",
        json_schema_extra=TUNING,
    )
    max_batch_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        le=1024 * 1024 * 1024,
        description="Largest KV-event message taken from a backend (ZMQ's MAXMSGSIZE): a"
        " larger one drops the connection (the index goes cold). vLLM publishes one batch per"
        " engine step: KBs (about 5 bytes a token it stores: 4 MiB is some 800,000 tokens in one"
        " step); decoding one takes the event loop ~20 ms a MiB.",
        json_schema_extra=TUNING,
    )
    resync_s: float = Field(
        0.0,
        ge=0,
        description="After a new connection to a backend's KV events or a gap in them (a"
        " lost batch), its index is dropped and holds only what it hears from then: it may"
        " miss blocks stored before, never claims one removed (partial). The chooser ignores"
        " it for this long (0: trusted at once). An engine heard from its first event, or an"
        " AllBlocksCleared, makes it exact at once.",
        json_schema_extra=TUNING,
    )
    idle_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A subscriber that receives nothing for this long checks the backend's"
        " `GET /kv_event_sources` again (the endpoint may have moved).",
        json_schema_extra=TUNING,
    )
    inline_bytes: int = Field(
        8192,
        ge=0,
        description="Prompts whose parsed body holds at most this many bytes (its text, four"
        " times over past ASCII, and each message's objects: what tokenizing scales with) are"
        " tokenized on the event loop (1-2 ms at most); larger ones on the proxy's two"
        " tokenizer threads (docs/performance.md has the cost).",
        json_schema_extra=TUNING,
    )
    max_prompt_tokens: int = Field(
        131072,
        ge=1,
        description="Prompts estimated past this many tokens get no blocks (placed by load):"
        " tokenizing megabytes takes a thread seconds and ~200 bytes of memory a token, for a"
        " prompt past most models' context.",
        json_schema_extra=TUNING,
    )


def kv_cache_on(kv_cache: KvCache, backend_policy: str) -> bool:
    """Whether the indexes run and prompt blocks are computed under this config."""
    if kv_cache.enabled is not None:
        return kv_cache.enabled
    return backend_policy in KV_AWARE_POLICIES
