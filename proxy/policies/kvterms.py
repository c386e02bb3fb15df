"""``backends: kv_aware``'s scoring terms, each a small function of one candidate and the
``Scene`` of the pick, and the one picker that ranks what they score.

A backend's score is ``CACHE_WEIGHT * cached_prefix + tier weight * room - queue_cost -
kv_overflow``, where ``room`` is ``free_share`` plus ``home_affinity``, ``queue_cost`` the tokens
queued there past the least queued anywhere (``proxy.policies.kvwork``) over the prompt's, and
``kv_overflow`` the KV memory the request would need there past the cache (``kvfit``);
``leaves_home`` (the balance rule) counts a busy over-share backend's cache as nothing. Scores
that tie fall back, in order, to the room, the cached prefix, ``balance`` (the smaller share of
the prompt blocks sent lately) and the rotation's age (docs in ``proxy.policies.kvaware``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic

from proxy.policies.backends import TIE, B, Candidate, free_share, slot_share
from proxy.policies.types import BackendView

CACHE_WEIGHT = 1.0  # the cached prefix's weight; the room's is the tier's latency weight

# The spread rule leaves a crowded home only for prompts it holds less of than this share: a
# conversation under way stays with its history (above 1: the rule moves every prompt). A new
# branch of a shared prefix (a tenant's new conversation) leaves a home its own tenant's work
# crowds (``Scene.own_crowded``) whatever the share: it loses that prefix once, not a history.
SPREAD_KEEPS = 0.5
# A prompt that no backend holds at least this share of (cached, or sent there lately) is placed
# as a new prefix: by room, then balance, as ``prefix_affinity`` places one. The short prefix it
# shares (a preamble under a tenant's own system prompt) saves it little once, while where it
# starts is where its conversations live: counted, it packed a group's tenants onto the engine
# of their preamble, past its cache, while others idled (``s94040``: 3.58x the prefill).
NEW_PLACEMENT_BELOW = 0.5
# A token of KV memory a request would need past a backend's cache (beside the requests in
# flight there: vLLM preempts one, or the cached prefixes of others go) against a token of
# prefill saved: 0.25 held best across the family (docs/policies.md).
OVERFLOW_WEIGHT = 0.25

# (score, room, cached tokens, -share lately, rotation age), compared in that order.
Key = tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class Scene:
    """What every term of one pick reads: the request and the backends' recent history."""

    prompt: int  # the prompt's length in tokens, at least 1
    weight: float  # the tier's weight of room against cache
    home: str | None  # the url of the prompt's (or its shared prefix's) home; None: none
    home_slots: float  # the free slots the home scores as if it had more
    home_cover: float  # the share of the prompt its home holds (or was sent), 0..1
    shares: Mapping[str, float]  # backend url -> its share of the prompt blocks sent lately
    over: set[str]  # the backends that took more than their share lately
    roomiest: float  # the most slot_share among the candidates (free slots, not KV held)
    may_move: bool  # the balance rule may move a shared prefix's home now
    crowded: frozenset[str] = frozenset()  # backends past their cap of the requests lately
    branch: bool = False  # the prompt goes on past its home's run otherwise than one that ran
    # backends past their cap of the prompt blocks filled lately whose excess the requesting
    # tenant's own blocks cover (``kvspread.RecentShares.own_crowded``)
    own_crowded: frozenset[str] = frozenset()
    work_weight: float = 0.0  # the tier's weight of a token queued ahead against one saved
    work: Mapping[str, float] = field(default_factory=dict)  # url -> tokens queued there
    least_work: float = 0.0  # the least of ``work`` among the candidates
    # url -> the KV tokens the request would need past its cache beside what is in flight
    # there, less the least of any candidate (``proxy.policies.kvfit``)
    overflow: Mapping[str, float] = field(default_factory=dict)
    # the tokens of prefill a wait for KV memory costs the request (``proxy.policies.kvwait``)
    overflow_wait: float = 0.0

    def home_stays(self) -> bool:
        """Whether the prompt keeps to its home (else the balance or the spread rule lets it
        go)."""
        return not ((self.may_move and self.home in self.over) or self.spreads(self.home))

    def spreads(self, url: str | None) -> bool:
        """Whether the spread rule sends this prompt off ``url`` (crowded, and not the home of
        most of the prompt, or the home of a new branch whose own tenant crowds it)."""
        if url not in self.crowded:
            return False
        if url != self.home or self.home_cover < SPREAD_KEEPS:
            return True
        return self.branch and url in self.own_crowded  # a new branch its own tenant crowds


def placed_as_new(known: int, scene: Scene) -> bool:
    """Whether a prompt of which ``known`` tokens at most are cached on one backend (or were
    sent to its home) is a new placement (``NEW_PLACEMENT_BELOW``)."""
    return known < NEW_PLACEMENT_BELOW * scene.prompt


def starts_apart_on(
    home: str | None,
    residents: Mapping[str, int],
    urls: Iterable[str],
    groups: int = 0,
    backends: int = 0,
) -> frozenset[str]:
    """Where a tenant's first prompt under a preamble that only other tenants of its cache
    group sent starts instead of joining it: the candidates (``urls``) no tenant lives on
    (``residents``: per backend, the other tenants living there lately), while one lives on
    the preamble's home; empty: it joins. Joined, two tenants' conversations would share one
    cache while another cache sat unused (``s32023``: 1.09x the prefill, ``s94002``); apart, it
    computes the preamble once more. Once every backend has a tenant it joins: apart, it would
    only hold the preamble twice (``s94059``). So it does where the tenants file has at least
    as many cache ``groups`` as there are ``backends``: each backend gets a group of its own by
    room and balance, and a group's first tenants arriving while a backend is still unlived
    (a start-up burst) only held their preamble twice (``s95051``, ``s95052``: 1.03x)."""
    if home is None or not residents.get(home) or (groups and groups >= backends):
        return frozenset()
    return frozenset(url for url in urls if not residents.get(url))


def no_worse_than_home(
    candidates: Sequence[Candidate[B]], apart: frozenset[str], scene: Scene
) -> list[Candidate[B]]:
    """Of the candidates in ``apart`` (``starts_apart_on``), those with at least the free slots
    of the prompt's home (``slot_share``, as the balance rule's "busier") and no more KV
    overflow (``Scene.overflow``: the KV memory that matters); empty: it joins its home.
    A tenant whose requests are cached repeats fills nothing, so lives nowhere: its traffic
    alone must not pin a newcomer onto the backend it keeps busy while home has room (red
    team, 2026-12-04: 7 of 8 slots in flight there and its cache past full, home idle)."""
    home = next((c for c in candidates if c.state.cfg.url == scene.home), None)
    room = slot_share(home) if home is not None else -1.0
    over = scene.overflow.get(scene.home or "", 0.0)
    return [
        c
        for c in candidates
        if c.state.cfg.url in apart
        and slot_share(c) >= room - TIE
        and scene.overflow.get(c.state.cfg.url, 0.0) <= over
    ]


def cached_prefix(saved_tokens: int, prompt: int) -> float:
    """The share of the prompt a backend would not have to prefill (at most all of it)."""
    return min(1.0, saved_tokens / prompt)


def leaves_home(c: Candidate[B], scene: Scene) -> bool:
    """Balance: a backend that took more than its share lately, and is busier than another
    now, counts nothing cached (a new branch of a shared prefix may start elsewhere). Spread:
    so does one past its cap of all requests lately (any prompt may start elsewhere: one
    engine never serves most of the work while others idle)."""
    url = c.state.cfg.url
    if scene.spreads(url):
        return True
    return scene.may_move and url in scene.over and slot_share(c) < scene.roomiest - TIE


def home_affinity(state: BackendView, scene: Scene) -> float:
    """The prompt's home scores as if it had up to ``home_slots`` more free slots (a share
    of its room), in proportion to the share of the prompt it holds: a conversation's home,
    nearly all; a short preamble that tenants share, little (packing every tenant under it onto
    one cache would evict what each of them holds alone); any other backend, nothing."""
    if scene.home is None or state.cfg.url != scene.home:
        return 0.0
    return scene.home_slots * scene.home_cover / max(1.0, state.max_room)


def queue_cost(state: BackendView, scene: Scene) -> float:
    """The cost model: the tokens queued ahead of the request on the backend, past the least
    any candidate has, as a share of its prompt and weighed by its tier, against the share of
    its prompt cached there (``cached_prefix``): a turn leaves its home when the prefill the
    home saves it is less than the work it would wait behind there."""
    extra = scene.work.get(state.cfg.url, 0.0) - scene.least_work
    return scene.work_weight * max(0.0, extra) / scene.prompt


def kv_overflow(state: BackendView, scene: Scene) -> float:
    """The KV memory the request would overfill on the backend beside the requests in flight
    there (past the least of any candidate), as a share of its prompt and weighed by
    ``OVERFLOW_WEIGHT``: room in slots is not room in KV memory, and a backend whose cache its
    requests in flight already fill preempts (and recomputes whole) whichever came last, or
    admits the request only once one of them is done (``Scene.overflow_wait``)."""
    over = scene.overflow.get(state.cfg.url, 0.0)
    wait = scene.overflow_wait if over > 0 else 0.0
    return (OVERFLOW_WEIGHT * over + wait) / scene.prompt


def balance(state: BackendView, scene: Scene) -> float:
    """The less a backend was sent lately, the better (a tie-break)."""
    return -scene.shares.get(state.cfg.url, 0.0)


@dataclass(frozen=True, slots=True)
class Scored(Generic[B]):
    state: B
    key: Key


def score(c: Candidate[B], saved: int, age: int, scene: Scene) -> Scored[B]:
    """``c`` scored: ``saved``, the tokens of the prompt cached there; ``age``, how long ago
    it was chosen (``Rotation.age``)."""
    room = free_share(c)
    if leaves_home(c, scene):
        saved = 0
    else:
        room += home_affinity(c.state, scene)
    total = CACHE_WEIGHT * cached_prefix(saved, scene.prompt) + scene.weight * room
    total -= queue_cost(c.state, scene)
    total -= kv_overflow(c.state, scene)
    rank = round(balance(c.state, scene) / TIE)
    return Scored(c.state, (round(total / TIE), round(room / TIE), saved, rank, age))


def pick_best(scored: Iterable[Scored[B]]) -> B | None:
    """The highest key; the first of equal ones."""
    best: Scored[B] | None = None
    for s in scored:
        if best is None or s.key > best.key:
            best = s
    return best.state if best is not None else None


def serves_home(scene: Scene, full: Sequence[BackendView]) -> bool:
    """Whether the request has a home to wait for: one of ``full`` (serves it and is up, not
    ejected nor draining, but has no free slot), and not one the balance rule lets it leave."""
    home = scene.home
    return bool(home) and scene.home_stays() and any(b.cfg.url == home for b in full)


def latency_weights(priorities: Mapping[str, int], best: float, worst: float) -> dict[str, float]:
    """Each tier's weight of room against cache, from ``best`` (the best priority) to
    ``worst`` (the worst), geometrically between; one priority alone gets ``best``."""
    ranks = sorted(set(priorities.values()))
    span = len(ranks) - 1
    return {
        tier: best * (worst / best) ** (ranks.index(p) / span) if span else best
        for tier, p in priorities.items()
    }
