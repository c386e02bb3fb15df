"""``backends: kv_aware``'s scoring terms, each a small function of one candidate and the
``Scene`` of the pick, and the one picker that ranks what they score.

A backend's score is ``CACHE_WEIGHT * cached_prefix + tier weight * room``, where ``room`` is
``free_share`` plus ``home_affinity``; ``leaves_home`` (the balance rule) counts a busy
over-share backend's cache as nothing. Scores that tie fall back, in order, to the room, the
cached prefix, ``balance`` (the smaller share of the prompt blocks sent lately) and the
rotation's age (docs in ``proxy.policies.kvaware``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from proxy.policies.backends import TIE, B, Candidate, free_share
from proxy.policies.types import BackendView

CACHE_WEIGHT = 1.0  # the cached prefix's weight; the room's is the tier's latency weight

# (score, room, cached tokens, -share lately, rotation age), compared in that order.
Key = tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class Scene:
    """What every term of one pick reads: the request and the backends' recent history."""

    prompt: int  # the prompt's length in tokens, at least 1
    weight: float  # the tier's weight of room against cache
    home: str | None  # the url of the prompt's (or its shared prefix's) home; None: none
    home_slots: float  # the free slots the home scores as if it had more
    shares: Mapping[str, float]  # backend url -> its share of the prompt blocks sent lately
    over: set[str]  # the backends that took more than their share lately
    roomiest: float  # the most free_share among the candidates
    may_move: bool  # the balance rule may move a shared prefix's home now

    def home_stays(self) -> bool:
        """Whether the prompt keeps to its home (else the balance rule lets it go)."""
        return not (self.may_move and self.home in self.over)


def cached_prefix(saved_tokens: int, prompt: int) -> float:
    """The share of the prompt a backend would not have to prefill (at most all of it)."""
    return min(1.0, saved_tokens / prompt)


def leaves_home(c: Candidate[B], scene: Scene) -> bool:
    """Balance: a backend that took more than its share lately, and is busier than another
    now, counts nothing cached (a new branch of a shared prefix may start elsewhere)."""
    url = c.state.cfg.url
    return scene.may_move and url in scene.over and free_share(c) < scene.roomiest - TIE


def home_affinity(state: BackendView, scene: Scene) -> float:
    """The prompt's home scores as if it had ``home_slots`` more free slots (a share of its
    room); any other backend, nothing."""
    if scene.home is None or state.cfg.url != scene.home:
        return 0.0
    return scene.home_slots / max(1.0, state.max_room)


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
