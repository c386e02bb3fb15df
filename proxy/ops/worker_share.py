"""`serve --workers N`: each worker's share of the per-process bounds, so that the port-wide
total is what the config says.

Each worker is a process of its own: its own listeners, heap, queues and tokenizer-call caps.
Left as written, N workers would admit N x ``server.max_connections`` connections, hold N x
``limits.max_held_bytes`` and queue N x each tier's ``max_queue``. Instead worker ``slot`` of N
takes ``total // N`` (plus one for the first ``total % N`` slots): the shares add up to the
config exactly, and the config means what an operator reads in it, the port's total. Bounds that
are global already are left alone: tenant limits, fairness and backend room go through the shared
state that ``--workers`` requires. Early refusal needs no share: each worker predicts a wait from
its own queue over its own measured service rate, both about 1/N of the port's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from proxy.config.schema import Config, LoadedConfig


@dataclass(frozen=True)
class WorkerShare:
    slot: int  # 0 .. workers - 1
    workers: int

    @classmethod
    def parse(cls, text: str) -> WorkerShare:
        """``SLOT/N`` as the owner passes it (``--worker-share``)."""
        slot, _, workers = text.partition("/")
        share = cls(int(slot), int(workers))
        if not 0 <= share.slot < share.workers:
            raise ValueError(f"worker share {text!r}: the slot must be in 0..N-1")
        return share

    def __str__(self) -> str:
        return f"{self.slot}/{self.workers}"

    def part(self, total: int) -> int:
        """This worker's share of ``total``; at least 1 where the total is (a bound of 0 stays
        0: nothing is allowed anywhere)."""
        base, rest = divmod(total, self.workers)
        share = base + (1 if self.slot < rest else 0)
        return max(share, 1 if total > 0 else 0)

    def config(self, cfg: Config) -> Config:
        held = cfg.limits.max_held_bytes
        return cfg.model_copy(
            update={
                "server": cfg.server.model_copy(
                    update={"max_connections": self.part(cfg.server.max_connections)}
                ),
                "limits": cfg.limits.model_copy(
                    update={"max_held_bytes": None if held is None else self.part(held)}
                ),
                "tiers": {
                    name: tier.model_copy(update={"max_queue": self.part(tier.max_queue)})
                    for name, tier in cfg.tiers.items()
                },
                "backends": [
                    b.model_copy(update={"max_cheap_inflight": self.part(b.max_cheap_inflight)})
                    for b in cfg.backends
                ],
            }
        )

    def apply(self, loaded: LoadedConfig) -> LoadedConfig:
        """``loaded`` with this worker's bounds (at start and on every reload)."""
        return dataclasses.replace(loaded, config=self.config(loaded.config))


def shares_summary(cfg: Config, workers: int) -> list[str]:
    """What the owner logs at start: each divided bound, its total and its per-worker shares."""
    shares = [WorkerShare(slot, workers) for slot in range(workers)]

    def line(name: str, total: int) -> str:
        parts = sorted({s.part(total) for s in shares})
        each = "/".join(str(p) for p in parts)
        return f"{name}: {total} in all, {each} per worker"

    lines = [line("server.max_connections", cfg.server.max_connections)]
    held = cfg.limits.max_held_bytes
    lines.append(
        "limits.max_held_bytes: unbounded" if held is None else line("limits.max_held_bytes", held)
    )
    lines += [line(f"tiers.{n}.max_queue", t.max_queue) for n, t in cfg.tiers.items()]
    lines += [
        line(f"backends[{b.name or b.url}].max_cheap_inflight", b.max_cheap_inflight)
        for b in cfg.backends
    ]
    return lines
