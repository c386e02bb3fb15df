"""A one-line progress bar on the terminal (a plain line every few seconds when not a tty)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from proxy.bench.records import OUTCOMES
from proxy.bench.runner import RunStatus


def render(status: RunStatus, width: int = 24) -> str:
    frac = 1.0 if status.duration <= 0 else min(1.0, status.elapsed / status.duration)
    filled = round(frac * width)
    bar = "#" * filled + "." * (width - filled)
    counts = " ".join(f"{o.value} {status.counts.get(o.value, 0)}" for o in OUTCOMES)
    phase = "send" if status.elapsed < status.duration else "drain"
    return (
        f"{status.label:>6} [{bar}] {status.elapsed:5.0f}/{status.duration:.0f}s {phase}"
        f"  sent {status.sent}/{status.planned}  in flight {status.inflight}  {counts}"
    )


class TerminalProgress:
    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last = 0.0

    def update(self, status: RunStatus) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + render(status))
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            print(render(status), file=self.stream, flush=True)

    def close(self, status: RunStatus) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        print(render(status), file=self.stream, flush=True)
