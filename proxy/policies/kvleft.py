"""Requests whose client left before the engine answered, for ``backends: kv_aware``: did the
engine run them? One that waited in vLLM's own queue and was aborted there computed nothing;
one that was prefilling or decoding (a non-streaming answer not yet whole) did. Stock vLLM
tells the proxy neither (its first byte comes with the first token; an abort is not evented),
but the engine's KV events do: a prefill that reached the engine's compute stores its prompt's
full blocks as it goes, and the backend's index shows them within the events' lag.

So a request that left unanswered waits here (its placement in flight as before) until its
backend's index shows a block of its prompt past those it showed when the request was sent:
it ran (it, or a twin of its prompt: the blocks are there either way); or until ``wait_s``
after it left (the chooser's own bound on the events' lag, ``pending_s``) with none shown: it
did not run, and leaves no trace. Where that cannot be told — the index cold, a prompt it held
whole when sent (nothing new to store), a prompt without blocks — it counts as run, as any
request that may have run does. What is told is what placement cares about: the blocks a
request stored, not whether it began (a prefill cut before its first full block stored
nothing, and counts as not run; a block stored and evicted before the look is not there).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policies.types import BackendView, QueuedRequest


@dataclass(slots=True)
class _Left:
    state: BackendView
    blocks: tuple[int, ...]
    shown: int  # the prompt's leading blocks its backend's index showed when it was sent
    at: float  # when its client left


class LeftUnanswered:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._left: dict[QueuedRequest, _Left] = {}

    def __len__(self) -> int:
        return len(self._left)

    def add(
        self, request: QueuedRequest, state: BackendView, shown: int | None, now: float
    ) -> bool:
        """The client of ``request`` (sent to ``state`` when its index showed ``shown`` of its
        prompt's blocks; None: cold) left before the engine answered. False: whether it ran
        cannot be told (it counts as run)."""
        blocks = request.prompt_blocks
        if not blocks or shown is None or shown >= len(blocks):
            return False
        if state.cached_blocks(blocks) is None:
            return False
        self._left[request] = _Left(state, tuple(blocks), shown, now)
        return True

    def settle(self, now: float) -> list[tuple[QueuedRequest, BackendView, bool]]:
        """Those now told: (request, backend, ran), out of the waiting."""
        told: list[tuple[QueuedRequest, BackendView, bool]] = []
        for key, left in list(self._left.items()):
            shown = left.state.cached_blocks(left.blocks)
            if shown is None or shown > left.shown:  # gone cold: as any that may have run
                told.append((key, left.state, True))
            elif now - left.at >= self.wait_s:
                told.append((key, left.state, False))
        for key, _, _ in told:
            del self._left[key]
        return told
