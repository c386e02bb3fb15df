"""``backends: kv_aware``: the backend where the request's prompt is already cached, weighed
against how busy it is, from each backend's index of vLLM's own KV-cache events.

A backend's score for a request is the share of its prompt it would not have to prefill there
(the longest cached prefix in tokens, ``cached_blocks * block_size``, over the prompt) plus the
tier's latency weight times the share of the backend's room left after taking it (in-flight
work and vLLM's own queue, as ``least_utilised`` sees them). A better tier weighs room more: a
high-tier request goes to an idle backend rather than queue behind a hot cache; a low-tier
batch request follows its cache onto a busier backend. Scores that tie (every index cold, or
no prefix cached anywhere) fall back to a balanced choice: the most room left, then the
longest cached prefix, then the backend chosen longest ago (never config order).

Between a dispatch and the KV events of its prefill, the index does not yet show the prompt: a
burst of one conversation's turns, or of one tenant's system prompt, would scatter. So the
chooser remembers where it sent each prompt's blocks and counts them as cached there while the
request runs (up to ``pending_s``), and after it ran for ``pending_s`` after it was sent only
while the backend's index is cold: a warm index has its events, and those of any eviction
since (``proxy.policies.kvmemory``: only what the engine ran is kept, in a share per tenant).

A prompt that no backend holds half of (cached, or sent to its home: ``kvterms.placed_as_new``)
is placed as new, by room and balance: a short prefix it shares with other tenants saves it
little once, while where it starts is where its conversations live. So is a tenant's first
prompt under a preamble only other tenants sent, while a tenant lives on its home and none on
another backend (``kvterms.starts_apart_on``), with the home's room there
(``kvterms.no_worse_than_home``), unless the tenants file has at least as many cache groups as
there are backends (``cache_groups``): two tenants' histories would share one cache.

Four rules keep each prefix in one place (each backend holding a copy would halve what both
caches hold) and the load even. Home: a prompt's home is the backend its deepest known block
was last sent to, or, for a new branch of a shared prefix (a tenant's new conversation under
its system prompt), that prefix's home (``kvgroups``); it scores as if it had up to
``home_slots`` more free slots, in proportion to the share of the prompt it holds. Hold: a
request whose home is full waits for it, up to its tier's hold
(``hold_s`` for the worst tier, less for better ones in proportion to their room weights), when
home would save at least ``hold_share`` of its prompt more than any backend with room, and
fewer wait for that home than it has slots; the dispatcher passes it over meanwhile and gives
the free slot to the next request. Balance: when a prefix's home took more than its share of
the prompt blocks filled lately (``balance_margin`` over ``1/n``, fading over ``balance_s``)
and is busier now, a new branch of it may start where there is room, and the prefix's home moves
there: one prefix per ``balance_s``, since the shares lag the move. Conversations under way
stay with their history. Spread: a backend past ``max_share`` of the requests sent lately counts
nothing cached while another can take the request (unless it holds half the prompt or more),
and so does, for a tenant's new conversation, a home past ``max_share`` of the prompt blocks
filled lately where the tenant's own fill the excess (``kvspread``: others' cached repeats and
refused requests fill nothing).

Cost model: the prefill each backend was sent and its KV events do not show done yet
(``proxy.policies.kvwork``: a request decoding counts a few tokens, however long its answer),
in tokens, weighs against the prefill its cache saves (``work_weight`` for the best tier,
worse tiers less), in the score and in the hold. KV memory: room in slots is not room in the
cache; the blocks the requests in flight on a backend hold (their prompts, each shared block
once, and their answers: ``proxy.policies.kvfit``) and the request's own, past the backend's
cache (vLLM's ``num_gpu_blocks``, scraped), are KV memory vLLM gets by preempting a request or
evicting others' prefixes: each such token costs ``OVERFLOW_WEIGHT`` of a token saved, and a
best-tier request's wait for it more (``proxy.policies.kvwait``).

A prompt whose blocks are unknown (its tokens not had in time) goes where its prefix last ran
(``proxy.policies.kvprefix``), by room otherwise. The score's terms and the picker are in
``kvterms``, the hold rule in ``kvhold``; this module keeps what the chooser remembers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from proxy.policies import kvterms
from proxy.policies.backends import B, Candidate, Rotation, slot_share
from proxy.policies.kvfit import KvInFlight
from proxy.policies.kvgroups import PrefixGroups
from proxy.policies.kvhold import HomeHold
from proxy.policies.kvleft import LeftUnanswered
from proxy.policies.kvmemory import PlacementMemory
from proxy.policies.kvprefix import PrefixHomes
from proxy.policies.kvsent import Sent
from proxy.policies.kvspread import RecentShares
from proxy.policies.kvterms import Scene, pick_best, placed_as_new, score, serves_home
from proxy.policies.kvwait import KvWait
from proxy.policies.kvwork import WorkAhead
from proxy.policies.types import BackendView, QueuedRequest


class KvAware:
    def __init__(
        self,
        *,
        block_size: int,
        latency_weights: Mapping[str, float],
        hold_s: float = 0.0,
        hold_share: float = 0.25,
        home_slots: float = 1.5,
        balance_margin: float = 0.05,
        balance_s: float = 30.0,
        balance_min: float = 16.0,
        pending_s: float = 10.0,
        pending_blocks: int = 65_536,
        max_share: float = 0.64,
        work_weight: float = 0.25,
        cache_groups: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.latency_weights = dict(latency_weights)  # tier -> weight of room against cache
        worst = min(self.latency_weights.values(), default=1.0)
        # tier -> the longest it waits for its prefix's home: hold_s for the worst tier.
        self.holds = {t: hold_s * worst / w for t, w in self.latency_weights.items()}
        # tier -> a token queued ahead against one of prefill saved: work_weight for the best.
        best = max(self.latency_weights.values(), default=1.0)
        self.work_weights = {t: work_weight * w / best for t, w in self.latency_weights.items()}
        self.hold_share = hold_share
        self.home_slots = home_slots
        self.balance_margin = balance_margin
        self.balance_s = balance_s
        self.balance_min = balance_min  # requests sent lately before shares are judged
        self.pending_s = pending_s
        self.max_share = max_share  # of the requests sent lately, past which a backend is left
        self.pending_blocks = pending_blocks
        self.clock = clock
        self.cache_groups = cache_groups  # of the tenants file (the apart rule; set on reloads)
        self._rotation = Rotation()
        self._work = WorkAhead(block_size)  # per backend, the prefill sent there not done
        # Where prompts' blocks were sent: in flight, then kept once the engine ran them.
        self.memory = PlacementMemory(pending_blocks, pending_s, clock)
        # A request in flight -> its prefix-group note, made once it ran (``PrefixGroups``).
        self._notes: dict[QueuedRequest, tuple[str, tuple[int, ...], int, str | None]] = {}
        self._hold = HomeHold(self.holds, hold_share)  # who waits for which home
        self._rooms: dict[str, float] = {}  # backend url -> its room, when last a candidate
        self._kv_blocks: dict[str, float] = {}  # backend url -> its KV cache, when last scraped
        self._fit = KvInFlight(block_size)  # per backend, the KV blocks in flight there
        # Shared prefixes, their new branches' home: a share per tenant of pending_blocks.
        self._groups = PrefixGroups(pending_blocks)
        # backend url -> prompt blocks filled lately, in all and per tenant (balance, spread)
        self._filled = RecentShares(max_share, balance_s, balance_min, clock)
        # backend url -> requests sent lately, in all (the spread rule; no tenant's own)
        self._requests = RecentShares(max_share, balance_s, balance_min, clock)
        self._rehomed_at = -math.inf  # when the balance rule last moved a prefix's home
        self._counted: dict[QueuedRequest, Sent] = {}  # in flight: what its sending counted
        self._prefix_homes = PrefixHomes()  # for a prompt whose blocks are unknown
        self._left = LeftUnanswered(pending_s)  # client gone before the engine answered
        self._wait = KvWait(self.latency_weights, balance_s, balance_min, clock)  # kvwait

    def cached_tokens(self, state: BackendView, blocks: Sequence[int]) -> int:
        """The longest prefix of ``blocks`` cached on ``state`` as its index shows, or sent there
        by a request still in flight (its KV events may not be in yet), in tokens. A block sent
        by a request that ran and ended counts only while the index is cold: a warm one heard
        its events, and the evictions since (counted anyway, a conversation under cache
        pressure kept following a history its home had evicted, and queued behind it)."""
        if not blocks:
            return 0
        indexed = state.cached_blocks(blocks)
        pending = self.memory.pending_run(state.cfg.url, blocks, kept=indexed is None)
        return max(indexed or 0, pending) * self.block_size

    def pick(
        self,
        candidates: Sequence[Candidate[B]],
        request: QueuedRequest | None,
        *,
        now: float | None = None,
        full: Sequence[B] = (),
    ) -> B | None:
        now = self.clock() if now is None else now
        blocks = request.prompt_blocks if request is not None else None
        self._expire(now)
        scene, home_run = self._scene(candidates, request, blocks, full)
        saved = [self.cached_tokens(c.state, blocks) if blocks else 0 for c in candidates]
        known = max(*saved, home_run * self.block_size, 0)  # cached anywhere, or sent home
        # A preamble only others sent (and no index shows more of the prompt): apart?
        if request is not None and blocks and max(saved, default=0) <= home_run * self.block_size:
            others = home_run > 0 and not self.memory.sent_by(request.tenant, blocks[home_run - 1])
            residents = self._filled.residents(request.tenant) if others else {}  # {}: it joins
            urls = (c.state.cfg.url for c in candidates)
            backends = max(len(candidates) + len(full), len(self._rooms))
            apart = kvterms.starts_apart_on(
                scene.home, residents, urls, self.cache_groups, backends
            )
            if apart and (roomy := kvterms.no_worse_than_home(candidates, apart, scene)):
                candidates, saved, known = roomy, [0] * len(roomy), 0
        if request is not None and placed_as_new(known, scene):
            saved = [0] * len(saved)  # no home: placed by room and balance
            scene, home_run = replace(scene, home=None, home_cover=0.0), 0
        if request is not None and not blocks:  # unknown blocks: where its prefix last ran
            prefix_home = self._prefix_homes.home(request.tenant, request.prefix_hash)
            if prefix_home is not None:
                scene = replace(scene, home=prefix_home, home_cover=1.0)
        best = pick_best(
            score(c, s, self._rotation.age(c.state), scene)
            for c, s in zip(candidates, saved, strict=True)
        )
        if request is not None and serves_home(scene, full):
            assert scene.home is not None
            # Wait only if home would save enough more than the best backend with room.
            gain = (home_run * self.block_size - max(saved, default=0)) / scene.prompt
            # ... and more than the work queued at home past the least queued with room.
            queued = scene.work_weight * (scene.work.get(scene.home, 0.0) - scene.least_work)
            if gain * scene.prompt >= queued and self._holds(request, scene.home, gain, now):
                return None  # its home is full: wait for it there (the dispatcher looks again)
        return best

    def _scene(
        self,
        candidates: Sequence[Candidate[B]],
        request: QueuedRequest | None,
        blocks: Sequence[int] | None,
        full: Sequence[BackendView] = (),
    ) -> tuple[Scene, int]:
        """What the terms read of this pick, and how many of the prompt's leading blocks its
        home was sent."""
        tenant = request.tenant if request is not None else None
        home, home_run = self.memory.home(blocks, tenant) if blocks else (None, 0)
        # A new branch of a shared prefix (a tenant's new conversation) goes to the prefix's
        # home. It loses only that prefix if it starts elsewhere: off a home that took more
        # than its share, it may (one prefix moved per balance_s: the shares lag the move).
        group = self._groups.home(blocks[home_run - 1]) if blocks and home_run else None
        for c in candidates:
            self._rooms[c.state.cfg.url] = c.state.max_room
            if c.load is not None and c.load.kv_blocks:
                self._kv_blocks[c.state.cfg.url] = c.load.kv_blocks
        shares = self._filled.shares()
        prompt = self._prompt_tokens(request, blocks)
        work = {c.state.cfg.url: self._work.of(c.state) for c in candidates}
        least_work = min(work.values(), default=0.0)
        work.update((b.cfg.url, self._work.of(b)) for b in full)
        scene = Scene(
            prompt=prompt,
            weight=self.latency_weights.get(request.tier, 1.0) if request is not None else 1.0,
            home=group or home,
            home_slots=self.home_slots,
            home_cover=min(1.0, home_run * self.block_size / prompt),
            shares=shares,
            over=self._over_share(shares),
            roomiest=max((slot_share(c) for c in candidates), default=0.0),
            may_move=group is not None and self.clock() - self._rehomed_at >= self.balance_s,
            crowded=self._requests.crowded(len(candidates)),
            branch=self._groups.branches(blocks or (), home_run),
            own_crowded=self._filled.own_crowded(tenant, len(candidates)),
            work_weight=self.work_weights.get(request.tier, 0.0) if request is not None else 0.0,
            work=work,
            least_work=least_work,
        )
        if request is None:
            return scene, home_run
        urls, out = [c.state.cfg.url for c in candidates], request.expected_output
        over, least = self._fit.excess(urls, blocks or (), out, self._kv_blocks)
        wait = self._wait.tokens(request.tier, least <= 0)  # what a wait for KV memory costs
        return replace(scene, overflow=over, overflow_wait=wait), home_run

    def _prompt_tokens(self, request: QueuedRequest | None, blocks: Sequence[int] | None) -> int:
        """The prompt's real length: its full blocks and a partial one (at least 1)."""
        if blocks:
            return (len(blocks) + 1) * self.block_size
        return max(1, request.prompt_tokens) if request is not None else 1

    def next_hold_end(self, now: float) -> float | None:
        """Seconds until the first hold still running ends; None: none is."""
        return self._hold.next_end(now)

    def left(self, request: QueuedRequest) -> None:
        # A held request whose client left no longer waits: its place at home is free.
        self._hold.drop(request)

    def _holds(self, request: QueuedRequest, home: str, gain: float, now: float) -> bool:
        """The hold rule (``HomeHold.waits``) for ``home``, capped at its room."""
        return self._hold.waits(request, home, gain, now, self._rooms.get(home, 1.0))

    def served(self, state: BackendView, request: QueuedRequest | None) -> None:
        self._rotation.chose(state)
        url, now = state.cfg.url, self.clock()
        blocks = request.prompt_blocks if request is not None else None
        saved = self.cached_tokens(state, blocks) if blocks else 0
        # Weighed by the blocks the prompt fills there (not those cached): four tenants' long
        # conversations fill a cache that a flood of short prompts, or one repeated, does not.
        filled = float(max(0, len(blocks) - saved // self.block_size) if blocks else 1)
        self._filled.sent(url, request.tenant if request is not None else None, filled)
        self._requests.sent(url, None)
        if request is None:
            return
        self._wait.sent(request.tier, filled)
        self._hold.drop(request)
        prefill = self._prompt_tokens(request, blocks) - saved
        self._work.sent(request, url, prefill, blocks or (), saved // self.block_size)
        self._fit.sent(request, url, blocks or (), request.expected_output)
        shown = state.cached_blocks(blocks) if blocks else None
        sent = Sent(url, now, filled, request.tenant, request.tier, shown)
        self._counted[request] = sent
        if not blocks:
            return
        holder, known = self.memory.home(blocks, request.tenant)
        group = self._groups.home(blocks[known - 1]) if known else None
        over = self._over_share(self._filled.shares())
        if group is not None and group != url and group in over:
            self._groups.rehome(blocks[known - 1], url)  # the balance rule moved it
            sent.rehomed = (blocks[known - 1], group, self._rehomed_at)
            self._rehomed_at = now
        self._notes[request] = (request.tenant, blocks, known, holder)  # noted once it ran
        self.memory.sent(request, request.tenant, url, blocks)

    def ended(self, state: BackendView, request: QueuedRequest | None, ran: bool | None) -> None:
        # Only what the engine ran shapes the memory (a 4xx, a failed connection: no trace).
        # None: the client left unanswered; in flight until the index tells (``kvleft``).
        if request is None:
            return
        self._work.ended(request)
        self._fit.ended(request)
        shown = sent.shown if (sent := self._counted.get(request)) is not None else None
        if ran is None and self._left.add(request, state, shown, self.clock()):
            return
        self._ended(state, request, ran is not False)

    def _ended(self, state: BackendView, request: QueuedRequest, ran: bool) -> None:
        sent = self._counted.pop(request, None)
        if sent is not None and not ran:
            self._unsend(sent)
        elif ran:
            self._prefix_homes.ran(request.tenant, request.prefix_hash, state.cfg.url)
        note = self._notes.pop(request, None)
        if self.memory.ended(request, ran=ran) is not None and note is not None:
            self._groups.note(*note)

    def _unsend(self, sent: Sent) -> None:
        """A request the engine did not run: out of the shares lately, and the prefix home it
        moved moved back (what never ran moves no tenant's placement)."""
        self._filled.unsent(sent.url, sent.tenant, sent.at, sent.filled)
        self._requests.unsent(sent.url, None, sent.at)
        self._wait.unsent(sent.tier, sent.at, sent.filled)
        if sent.rehomed is not None:
            block, before, rehomed_at = sent.rehomed
            if self._groups.home(block) == sent.url:
                self._groups.rehome(block, before)
                self._rehomed_at = rehomed_at

    def _over_share(self, shares: Mapping[str, float]) -> set[str]:
        """The backends that took more than their share lately (of every backend seen)."""
        fair = 1.0 / max(1, len(shares), len(self._rooms))
        return {url for url, share in shares.items() if share > fair + self.balance_margin}

    def _expire(self, now: float) -> None:
        """``now``: the pool's clock, that of the requests' arrivals and holds."""
        self._hold.expire(now)
        for request, state, ran in self._left.settle(self.clock()):
            self._ended(state, request, ran)
