"""A prompt's KV-cache blocks on the proxy's side: its tokens exactly as vLLM will see them (the
chat template rendered as transformers renders it for vLLM, then tokenized without special
tokens; a completion's prompt tokenized with them), cut into ``kv_cache.block_size`` blocks and
hashed as the KV-event index hashes what an engine stored (``proxy.policies.blockhash``), the
request's cache salt in the first block.

Only what vLLM renders the same way for sure is computed: chat messages of a role and text
content, a completion's one prompt (text or token ids), and no field that changes the rendering
(tools, documents, template kwargs, ...). Anything else gets None (the chooser falls back to
load), never a guess. Computed only when ``kv_cache`` is on and a tokenizer is configured;
bodies past ``kv_cache.inline_bytes`` are tokenized in a worker thread (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import jinja2
from tokenizers import Tokenizer

from proxy.api.errors import bad_request
from proxy.backends.counts import TenantCounts
from proxy.backends.pool import BackendPool
from proxy.config.kv_cache import KvCache, kv_cache_on
from proxy.config.schema import Config
from proxy.policies.blockhash import BlockKeys, chain_hashes
from proxy.request.billing import model_context
from proxy.request.chat_template import SPECIAL_TOKENS, template_env, token_text
from proxy.request.inbound import ParsedRequest
from proxy.request.kv_prompt import ChatPrompt, IdsPrompt, TextPrompt
from proxy.request.remote_tokens import RemoteTokenizer
from proxy.request.route_table import ROWS
from proxy.request.tiered_threads import FIRST, TieredThreads
from proxy.request.tokencache import PrefixTokenCache, encode_ids

if TYPE_CHECKING:
    from proxy.request.admitted import Admitted

log = logging.getLogger("tierproxy.prompt_blocks")

# Long prompts are tokenized on threads of their own (not asyncio's default pool, which config
# reloads use too), taken in tier order, at most this many of one tenant at once: past it a
# tenant's request goes without blocks (placed by load) rather than queue for a thread. Eight
# 1 MB prompts of one tenant pushed the others' latency from 3 ms to 365 ms on the shared pool
# (fresh eyes t02).
TOKENIZER_THREADS = 2
PER_TENANT_OFF_LOOP = 1


class ModelTokenizer:
    """The served model's tokenizer and chat template, loaded from its directory."""

    def __init__(self, directory: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {k: t for k in SPECIAL_TOKENS if (t := token_text(config.get(k)))}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: vLLM uses "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        template_file = directory / "chat_template.jinja"
        if template_file.exists():
            source = template_file.read_text()
        self.template = template_env().from_string(source) if isinstance(source, str) else None
        self.prefixes = PrefixTokenCache(self.tokenizer)  # a conversation's earlier turns

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        assert self.template is not None
        text = self.template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self.special,
        )
        return self.prefixes.encode(text)

    def text_tokens(self, text: str) -> list[int]:
        return encode_ids(self.tokenizer, text, add_special_tokens=True)


def load_model(directory: str) -> ModelTokenizer | None:
    """The tokenizer and template of ``directory``, used once before any request needs them
    (the first encode and render allocate); None when unusable (logged)."""
    try:
        model = ModelTokenizer(Path(directory))
        model.text_tokens("warm")
    except Exception as exc:  # a missing file, bad JSON, a template that does not compile
        log.warning("kv_cache.tokenizer %s unusable: %s", directory, exc)
        return None
    try:
        if model.template is not None:
            model.chat_tokens([{"role": "user", "content": "warm"}])
    except jinja2.exceptions.TemplateError:
        pass  # a template that wants more than one message; requests render their own
    except Exception as exc:  # a template broken for any chat (fresh eyes round seven F1)
        log.warning(
            "kv_cache.tokenizer %s: its chat template fails on a one-message chat (%s: %s);"
            " chats get no blocks",
            directory,
            type(exc).__name__,
            exc,
        )
        model.template = None
    return model


def prompt_tokens(model: ModelTokenizer, parsed: ParsedRequest) -> list[int] | None:
    """The prompt's token ids as vLLM will see them (the route's ``kv_prompt``); None when
    not surely the same."""
    source = ROWS[parsed.endpoint].kv_prompt
    prompt = source.local(parsed.body) if source is not None else None
    if isinstance(prompt, ChatPrompt):
        return model.chat_tokens(prompt.messages) if model.template is not None else None
    if isinstance(prompt, TextPrompt):
        return model.text_tokens(prompt.text)
    return prompt.ids if prompt is not None else None


def given_tokens(parsed: ParsedRequest) -> list[int] | None:
    """A prompt given as token ids: used as they are, no tokenizer needed."""
    source = ROWS[parsed.endpoint].kv_prompt
    prompt = source.local(parsed.body) if source is not None else None
    return prompt.ids if isinstance(prompt, IdsPrompt) else None


def prompt_block_hashes(
    model: ModelTokenizer,
    parsed: ParsedRequest,
    block_size: int,
    salt: str | BlockKeys,
    context: int | None = None,
) -> tuple[int, ...] | None:
    """The blocks vLLM can serve from its cache: the full blocks of all but the last token
    (it computes at least one token of every prompt), so that a backend holding ``n`` of them
    saves exactly ``n * block_size`` tokens of prefill. Raises ``PastContext``."""
    return _blocks(prompt_tokens(model, parsed), block_size, salt, context)


def _on_loop(
    loop: asyncio.AbstractEventLoop, call: Callable[[str], None], arg: str, _: object
) -> None:
    """``call(arg)`` on ``loop`` from whichever thread ends a job; nothing once it closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(call, arg)


def _unusable(load: Future[ModelTokenizer | None]) -> bool:
    return load.exception() is not None or load.result() is None


class Upstreams(Protocol):
    """Where a backend's /tokenize is reached (the request pipeline)."""

    pool: BackendPool
    clock: Callable[[], float]
    session: Callable[[], aiohttp.ClientSession]


class PastContext(Exception):
    """The prompt leaves no room for one output token in the model's context: vLLM would
    refuse it before any work. The proxy refuses it itself (``PromptBlocks.given``): a flood of
    them held backend slots and the engines' tokenizing, and moved others' turns (red team)."""

    def __init__(self, tokens: int, context: int) -> None:
        super().__init__(f"{tokens} tokens past a context of {context}")
        self.tokens, self.context = tokens, context


def _blocks(
    tokens: list[int] | None, block_size: int, salt: str | BlockKeys, context: int | None = None
) -> tuple[int, ...] | None:
    """``prompt_block_hashes`` of tokens already known (None: none are); raises
    ``PastContext`` for a prompt past the model's ``context``."""
    if not tokens:
        return None
    if context is not None and len(tokens) >= context:
        raise PastContext(len(tokens), context)
    return chain_hashes(tokens[:-1], block_size, salt)


class PromptBlocks:
    """Computes a request's ``QueuedRequest.prompt_blocks`` when the config asks for them: with
    the local tokenizer where one is configured, else with a backend's /tokenize. One per
    server (``proxy.server.state`` builds it and hands it to the pipeline): a tokenizer loaded
    once serves every request."""

    def __init__(self) -> None:
        # By directory, loaded or loading (unusable: None or an exception). A thread's future,
        # not asyncio's: the config reload's thread and any event loop wait on the same load.
        self._models: dict[str, Future[ModelTokenizer | None]] = {}
        self._loads = threading.Lock()
        self.remote = RemoteTokenizer()
        self._threads = TieredThreads(TOKENIZER_THREADS, "tierproxy-tokenize")
        self.off_loop = TenantCounts()  # each tenant's prompts on those threads now
        self._template_failed = False  # logged once

    async def _on_thread(
        self,
        tenant: str,
        work: Callable[[], tuple[int, ...] | None],
        priority: int = 0,
        start_within_s: float = 0.5,
    ) -> tuple[int, ...] | None:
        """``work`` on a tokenizer thread, or None (placed by load: the blocks are a hint)
        when its tenant has one there already or no thread takes it within
        ``start_within_s`` (better tiers' prompts go first and could keep it waiting for
        ever: fresh eyes round seven F2)."""
        if not self.off_loop.take(tenant, PER_TENANT_OFF_LOOP):
            return None  # the tenant's earlier long prompts come first; this one by load
        job = self._threads.submit(priority, work)
        # The tenant's share comes back when its work ends, not when its client leaves: what
        # runs is never stopped, and leaving must not let a tenant start more (round seven F3).
        job.add_done_callback(
            partial(_on_loop, asyncio.get_running_loop(), self.off_loop.give_back, tenant)
        )
        result = asyncio.wrap_future(job)
        try:
            done, _ = await asyncio.wait([result], timeout=start_within_s)
            if not done and job.cancel():
                return None  # never started: dropped
            return await result
        except asyncio.CancelledError:
            job.cancel()  # its client left: dropped unless it already runs
            raise

    def _load(self, directory: str, retry: bool = False) -> Future[ModelTokenizer | None]:
        """The one load of ``directory``'s tokenizer, started by whoever asks first: the first
        requests after a start used to load it once each, on threads that fought for the GIL
        (40-50 ms of queueing in the kv-routing benchmark's opening burst)."""
        with self._loads:
            load = self._models.get(directory)
            if load is None or (retry and load.done() and _unusable(load)):
                load = self._threads.submit(FIRST, partial(load_model, directory))
                self._models[directory] = load
        return load

    def preload(self, config: Config) -> None:
        """Load the configured tokenizer now, in the calling thread's time (the server's start
        and a config reload, off the event loop), so that no request waits for it."""
        kv = config.kv_cache
        if kv.tokenizer is not None and kv_cache_on(kv, config.policies.backends):
            load = self._load(kv.tokenizer, retry=True)  # the files may have been fixed
            concurrent.futures.wait([load])  # unusable: logged; requests get no blocks

    async def _model(self, directory: str) -> ModelTokenizer | None:
        load = self._load(directory)
        if not load.done():
            # Shielded: a request that leaves while it waits must not cancel everyone's load.
            await asyncio.shield(asyncio.wait([asyncio.wrap_future(load)]))
        return None if _unusable(load) else load.result()

    async def compute(
        self,
        config: Config,
        parsed: ParsedRequest,
        salt: str | BlockKeys,
        via: Upstreams | None = None,
        tenant: str = "",
        priority: int = 0,
        context: int | None = None,
    ) -> tuple[int, ...] | None:
        """``priority``: the request's tier's (lower first), for a thread's turn; ``context``:
        the model's (``max_model_len``; None: unknown), past which a prompt is not hashed."""
        kv: KvCache = config.kv_cache
        if not kv_cache_on(kv, config.policies.backends):
            return None
        if parsed.prompt_tokens > kv.max_prompt_tokens:
            return None  # seconds of a thread and its weight in memory, past most contexts
        inline = parsed.held_bytes <= kv.inline_bytes
        tokens = given_tokens(parsed)
        if kv.tokenizer is None or tokens is not None:
            if tokens is None and via is not None:
                session, now = via.session(), via.clock()
                tokens = await self.remote.tokens(parsed, kv, via.pool, session, now, tenant)
            if inline:
                return _blocks(tokens, kv.block_size, salt, context)
            work = partial(_blocks, tokens, kv.block_size, salt, context)
            return await self._on_thread(tenant, work, priority, kv.tokenize_timeout_s)
        model = await self._model(kv.tokenizer)
        if model is None:
            return None
        try:
            if inline:
                return prompt_block_hashes(model, parsed, kv.block_size, salt, context)
            hashes = partial(prompt_block_hashes, model, parsed, kv.block_size, salt, context)
            return await self._on_thread(tenant, hashes, priority, kv.tokenize_timeout_s)
        except jinja2.exceptions.TemplateError:
            return None  # vLLM would refuse it too (its template raised)
        except PastContext:
            raise
        except Exception as exc:  # a template bug this request reaches: placed by load
            if not self._template_failed:
                self._template_failed = True
                log.warning(
                    "kv_cache.tokenizer %s: a prompt failed to render: %r", kv.tokenizer, exc
                )
            return None

    async def given(self, adm: Admitted, via: Upstreams) -> Admitted:
        """``adm``, its queue entry given its prompt's KV-cache blocks (for the kv_aware
        chooser; None while kv_cache is off) on its first attempt: computed once it may run,
        before it is queued. Its prompt's estimate and expected output are capped at the
        model's context (``QueuedRequest.bound_by_context``); a prompt counted past it, or a
        client's output budget past it (``ParsedRequest.keep_output_within``), is refused as vLLM
        would: it could never run, and under ``max_tokens_inflight`` it waited for an idle
        backend until its queue timeout (a 503 to retry) rather than get vLLM's 400 (red
        team)."""
        if adm.attempts == 0:
            context = model_context(adm.context_model, (s.model_cards for s in via.pool.all()))
            if context is not None:
                adm.parsed.keep_output_within(context)
                adm.queued.bound_by_context(context, adm.parsed.sequences)
            try:
                adm.queued.prompt_blocks = await self.compute(
                    adm.config,
                    adm.parsed,
                    BlockKeys(adm.cache_salt, adm.adapter),
                    via,
                    adm.tenant.name,
                    adm.config.tiers[adm.tier].priority,
                    context,
                )
            except PastContext as exc:  # vLLM's 400, without a slot or its tokenizing
                raise bad_request(
                    f"This model's maximum context length is {exc.context} tokens. However,"
                    f" your request has {exc.tokens} input tokens. Please reduce the length of"
                    " the input.",
                    code="context_length_exceeded",
                ) from None
        return adm
