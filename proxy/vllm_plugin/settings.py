"""The plugin's knobs, read from the environment of the vLLM processes.

vLLM starts the API server and the engine core as separate processes, and neither has a place
for plugin flags, so both halves of the plugin read the same environment variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from proxy.ticket import DEFAULT_PREFILL_SHARE, DEFAULT_SECRET_ENV, check_secret, secret_from_env

ENV_UNTICKETED_PRIORITY = "TIERPROXY_UNTICKETED_PRIORITY"
ENV_REQUIRE_TICKET = "TIERPROXY_REQUIRE_TICKET"
ENV_MAX_PREEMPTIONS = "TIERPROXY_MAX_PREEMPTIONS"
ENV_DEFAULT_PREFILL_SHARE = "TIERPROXY_DEFAULT_PREFILL_SHARE"
ENV_STATS_INTERVAL_S = "TIERPROXY_PLUGIN_STATS_INTERVAL_S"
ENV_TICKET_WINDOW_S = "TIERPROXY_TICKET_WINDOW_S"
ENV_TICKET_MAX_SKEW_S = "TIERPROXY_TICKET_MAX_SKEW_S"
ENV_REPLAY_CACHE_SIZE = "TIERPROXY_REPLAY_CACHE_SIZE"

# The example config's lowest tier ("low") has priority 10; an unticketed caller gets no more.
DEFAULT_UNTICKETED_PRIORITY = 10
DEFAULT_MAX_PREEMPTIONS = 2
DEFAULT_STATS_INTERVAL_S = 10.0
# A ticket is signed just before the proxy sends its request: 30 s covers a slow upload and
# clock drift between hosts, and bounds how long a nonce is remembered.
DEFAULT_TICKET_WINDOW_S = 30.0
# How far the proxy's clock may run ahead of the plugin's.
DEFAULT_TICKET_MAX_SKEW_S = 5.0
# Live nonces one API-server process remembers (~200 B each): 100,000 is 3,300 requests/s
# for the whole window; beyond it tickets are refused, never forgotten early.
DEFAULT_REPLAY_CACHE_SIZE = 100_000


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True, slots=True)
class MiddlewareSettings:
    secret: bytes
    unticketed_priority: int = DEFAULT_UNTICKETED_PRIORITY
    require_ticket: bool = False
    ticket_window_s: float = DEFAULT_TICKET_WINDOW_S
    ticket_max_skew_s: float = DEFAULT_TICKET_MAX_SKEW_S
    replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE

    def __post_init__(self) -> None:
        # The plugin refuses to start rather than trust tickets signed with a guessable key.
        check_secret(self.secret)
        if self.ticket_window_s <= 0 or self.ticket_max_skew_s < 0:
            raise ValueError(f"{ENV_TICKET_WINDOW_S} must be > 0, {ENV_TICKET_MAX_SKEW_S} >= 0")
        if self.replay_cache_size < 1:
            raise ValueError(f"{ENV_REPLAY_CACHE_SIZE} must be >= 1")

    @classmethod
    def from_env(cls) -> MiddlewareSettings:
        return cls(
            secret=secret_from_env(DEFAULT_SECRET_ENV),
            unticketed_priority=_env_int(ENV_UNTICKETED_PRIORITY, DEFAULT_UNTICKETED_PRIORITY),
            require_ticket=_env_flag(ENV_REQUIRE_TICKET),
            ticket_window_s=_env_float(ENV_TICKET_WINDOW_S, DEFAULT_TICKET_WINDOW_S),
            ticket_max_skew_s=_env_float(ENV_TICKET_MAX_SKEW_S, DEFAULT_TICKET_MAX_SKEW_S),
            replay_cache_size=_env_int(ENV_REPLAY_CACHE_SIZE, DEFAULT_REPLAY_CACHE_SIZE),
        )


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    # Anti-thrash: a request is preempted for a better tier at most this many times.
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    # Share for requests whose extra_args carry none (no ticket reached the middleware).
    default_prefill_share: float = DEFAULT_PREFILL_SHARE
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S

    def __post_init__(self) -> None:
        if self.max_preemptions < 0:
            raise ValueError(f"{ENV_MAX_PREEMPTIONS} must be >= 0")
        if not 0 < self.default_prefill_share <= 1:
            raise ValueError(f"{ENV_DEFAULT_PREFILL_SHARE} must be in (0, 1]")

    @classmethod
    def from_env(cls) -> SchedulerSettings:
        return cls(
            max_preemptions=_env_int(ENV_MAX_PREEMPTIONS, DEFAULT_MAX_PREEMPTIONS),
            default_prefill_share=_env_float(ENV_DEFAULT_PREFILL_SHARE, DEFAULT_PREFILL_SHARE),
            stats_interval_s=_env_float(ENV_STATS_INTERVAL_S, DEFAULT_STATS_INTERVAL_S),
        )
