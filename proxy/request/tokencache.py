"""Tokenizing a rendered chat prompt once per prefix: a conversation's next turn repeats the
whole text of the turns before it, so the tokens of that text are kept (LRU, bounded in tokens)
and only the new tail is tokenized.

Exact only where tokenization cannot merge across the split: the text is cut right after a
special added token (the tokenizer splits its input at those first and tokenizes the pieces
apart), one that absorbs no whitespace around it (``lstrip``/``rstrip``), and not with a
``Metaspace`` pre-tokenizer that prepends to the input's first piece only (``prepend_scheme:
first``). A text seen for the first time is tokenized whole (exact by definition) and the
tokens of its longest cut prefix kept, found by the token that ends right at the cut; a text
whose prefix is known is tokenized from the cut on, and the first ``VERIFY`` of those splits
per tokenizer are checked against a whole tokenization: one mismatch turns the cache off for
it, for good (logged).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from hashlib import blake2b

from tokenizers import Encoding, Tokenizer

log = logging.getLogger("tierproxy.prompt_blocks")

VERIFY = 16
# tokenizers' ``encode`` keeps the GIL for the whole text: a 676 KB prompt tokenized on a worker
# thread stopped the event loop for ~0.9 s (fresh eyes, round six F7). ``encode_batch`` lets it
# go while Rust works, for ~25 µs more a call: texts shorter than this (under ~1 ms of encode)
# keep ``encode``.
GIL_FREE_CHARS = 4_096
_PROBES = 8  # split points tried from the end for a cached prefix


def _splits_at_specials(tokenizer: Tokenizer) -> list[str]:
    """The special tokens after which a text can be cut exactly; [] when none can."""
    if "prepend_scheme" in str(tokenizer.pre_tokenizer) and "first" in str(tokenizer.pre_tokenizer):
        return []
    return [
        t.content
        for t in tokenizer.get_added_tokens_decoder().values()
        if t.special and not t.lstrip and not t.rstrip and t.content
    ]


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """``text``'s encoding; a long text's without holding the GIL."""
    if len(text) < GIL_FREE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids; a long text's without holding the GIL."""
    return list(encode_text(tokenizer, text, add_special_tokens).ids)


def _tokens_before(encoding: Encoding, cut: int) -> int | None:
    """How many of ``encoding``'s tokens come before character ``cut``: the token holding the
    character before the cut must end right at it (None: a token spans the cut)."""
    last = encoding.char_to_token(cut - 1)
    if last is None:
        return None
    span = encoding.token_to_chars(last)
    return last + 1 if span is not None and span[1] == cut else None


def _keys(text: str, cuts: list[int]) -> dict[int, bytes]:
    """The digest of ``text[:cut]`` for each cut, in one pass over the text."""
    h = blake2b(digest_size=16)
    keys: dict[int, bytes] = {}
    at = 0
    for cut in sorted(cuts):
        h.update(text[at:cut].encode("utf-8", "surrogatepass"))
        keys[cut], at = h.copy().digest(), cut
    return keys


class PrefixTokenCache:
    """Token ids of rendered prompts' prefixes (cut after a special token), by the prefix's
    text digest; at most ``max_tokens`` tokens held."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self.specials = _splits_at_specials(tokenizer)
        self.max_tokens = max_tokens
        self._held = 0
        self._prefixes: OrderedDict[bytes, array[int]] = OrderedDict()
        self.verify_left = VERIFY
        self.hits = 0
        self._lock = threading.Lock()  # long prompts are tokenized in worker threads

    @property
    def enabled(self) -> bool:
        return bool(self.specials)

    def _cuts(self, text: str) -> list[int]:
        """Positions right after special tokens, last first (at most ``_PROBES``)."""
        cuts: set[int] = set()
        for special in self.specials:
            end = len(text)
            for _ in range(_PROBES):
                at = text.rfind(special, 0, end)
                if at <= 0:
                    break
                cuts.add(at + len(special))
                end = at
        return sorted(cuts, reverse=True)[:_PROBES]

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids without special tokens added, as one encode would give them."""
        cuts = self._cuts(text) if self.specials else []
        if not cuts:
            return self._encode(text)
        keys = _keys(text, cuts)
        start, head = 0, []
        with self._lock:
            for cut in cuts:  # the longest prefix already tokenized
                cached = self._prefixes.get(keys[cut])
                if cached is not None:
                    self._prefixes.move_to_end(keys[cut])
                    self.hits += 1
                    start, head = cut, cached.tolist()
                    break
        last = cuts[0]
        if start == 0:  # a first sight: one whole encode, its head kept for the next turn
            encoding = encode_text(self.tokenizer, text, add_special_tokens=False)
            ids = list(encoding.ids)
            before = _tokens_before(encoding, last)
            if before is not None:
                with self._lock:
                    self._put(keys[last], array("i", ids[:before]))
            return ids
        if start < last:
            head += self._encode(text[start:last])
        ids = head + self._encode(text[last:])
        if self.verify_left > 0:
            self.verify_left -= 1
            whole = self._encode(text)
            if whole != ids:
                log.warning("prompt tokens cut after special tokens differ: prefix cache off")
                with self._lock:
                    self.specials = []
                    self._prefixes.clear()
                    self._held = 0
                return whole
        if start < last:
            with self._lock:
                self._put(keys[last], array("i", head))
        return ids

    def _encode(self, text: str) -> list[int]:
        return encode_ids(self.tokenizer, text, add_special_tokens=False)

    def _put(self, key: bytes, tokens: array[int]) -> None:
        old = self._prefixes.pop(key, None)
        if old is not None:
            self._held -= len(old)
        self._prefixes[key] = tokens
        self._held += len(tokens)
        while self._held > self.max_tokens and self._prefixes:
            _, dropped = self._prefixes.popitem(last=False)
            self._held -= len(dropped)
