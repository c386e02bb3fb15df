"""What a streamed answer relayed to its client, counted as it goes: the bill of a stream that
ends without the backend's usage (the client left after reading almost everything, the tier's
time limit cut it, the backend broke mid-stream). Such a stream is billed what it delivered,
never nothing.

The count is of events, not of tokens, and it is a lower bound: vLLM sends each chunk for one
engine step of one choice, at least one generated token (more with speculative decoding or a
``--stream-interval`` above 1). Counting them costs one ``bytes.count`` per block written (in
C: no JSON parsed per chunk; ~0.1-0.2 µs an event, benchmarks/delivered_bench.py); a chat
stream's opening chunk of each choice (its ``role``) carries no token and is not counted.

vLLM's ``stream_options.continuous_usage_stats`` was weighed and not used: its counts are per
choice (``previous_num_tokens[i]``), so the last one seen undercounts ``n`` > 1 and prompt
lists as much, and it would add ~90 bytes to every chunk and a rewrite of every chunk to strip
them for the clients that did not ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass

# A chat or completions chunk with a choice (the usage chunk's choices are empty).
_CHOICE = b'"choices":[{'
# Chat's opening chunk of a choice, ``"delta":{"role":"assistant","content":""}``: no token.
_ROLE = b'"role":'
# A Responses stream's token-bearing events: response.output_text.delta,
# response.reasoning_text.delta, response.function_call_arguments.delta ... (their ``type``
# field; the ``event:`` line ends in a newline, not a quote).
_RESPONSES_DELTA = b'.delta"'


@dataclass(slots=True)
class Delivered:
    """Events with generated tokens written to the client, over every attempt (a retry
    happens only before the first byte, so at most one attempt counts any)."""

    events: int = 0
    # The request went to a backend and that attempt neither answered nor failed yet: a client
    # that leaves now leaves work done (vLLM prefilled, maybe decoded); cleared on a failure.
    sent: bool = False
    _past_roles: bool = False  # a token chunk was seen: no opening chunk comes after it

    def chunks(self, block: bytes) -> None:
        """A block of chat or completions events was written. One scan per block; the
        opening chunks (chat's role, all sent before any token) are looked for only until
        the first token chunk."""
        count = block.count(_CHOICE)
        if not self._past_roles:
            count -= block.count(_ROLE)
            self._past_roles = count > 0
        self.events += count

    def responses_event(self, event: bytes) -> None:
        """One Responses API event was written."""
        if _RESPONSES_DELTA in event:
            self.events += 1
