"""SIGHUP while ``tierproxy serve`` starts: noted, not fatal.

SIGHUP's default action ends a process, and the config watcher takes the signal over only once
the app runs (seconds of imports and config loading later). A reload asked for meanwhile (a
deploy tool that writes the file and signals just after a restart) would stop the proxy with no
line in its log. ``defer_reloads`` is the first thing ``serve`` does; the watcher applies what
was noted as soon as it is up.
"""

from __future__ import annotations

import signal
from types import FrameType

_noted = 0


def _note(signum: int, frame: FrameType | None) -> None:
    global _noted
    _noted += 1


def defer_reloads() -> None:
    """From now until a watcher installs its own handler, a SIGHUP is counted."""
    signal.signal(signal.SIGHUP, _note)


def take_deferred_reloads() -> int:
    """How many SIGHUPs arrived before the watcher was up (and forget them)."""
    global _noted
    noted, _noted = _noted, 0
    return noted
