"""A child process that cannot outlive us: its own process group, one stop path, a log file.

The base of the vLLM engines (proxy/tools/engine.py) and of the proxy the bench starts as
`tierproxy serve` (proxy/bench/stack.py): each is started in a new session, so that stopping
it (SIGTERM to the group, a grace period, then SIGKILL) stops every child it forked; each gets
SIGTERM when the process that started it dies, however it dies (Linux), so a crashed test run
or launcher never leaves a 3 GB engine behind; each may be confined to some CPU cores.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self


class StopOnExit(ABC):
    """``with thing:`` stops it on the way out, whatever happened inside."""

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ManagedProcess(StopOnExit):
    """``command`` run with ``env`` (None: ours), output to ``log_path`` (None: ours), on
    ``cpus`` (None: any core)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cpus: frozenset[int] | None = None,
        name: str = "process",
    ) -> None:
        self.command = list(command)
        self.env = dict(env) if env is not None else None
        self.log_path = log_path
        self.cpus = cpus
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> Self:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        cpus = self.cpus

        def in_child() -> None:
            _die_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            preexec_fn=in_child,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_until(
        self, ready: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.3
    ) -> None:
        """Block until ``ready()``; raises (with the log's tail) if the process exits first or
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before {what}; {self.log_hint()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: no {what} within {timeout_s:.0f}s; {self.log_hint()}"
                )
            time.sleep(poll_s)

    def log_hint(self) -> str:
        if self.log_path is None:
            return "see its output above"
        return f"log: {self.log_path}\n{tail(self.log_path)}"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process group."""
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the group, ``grace_s`` to exit, then SIGKILL; idempotent."""
        if self.proc is not None:
            if self.alive():
                self.signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.signal(signal.SIGKILL)
                    self.proc.wait(timeout=10)
            # Children left behind in the group (an engine's core and workers) go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Looked up here, in the parent: the child, between fork and exec, must not import or load.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started us dies (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def http_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


_PORTS_FLOOR = 10_000
# "low-high": the ports free_port draws from, for processes on one machine that pick ports at
# once and must not pick the same (the suite's two halves: a proxy's port taken by an engine's
# KV-event publisher between the pick and the bind answered its health check in ZMQ).
PORT_RANGE_ENV = "TIERPROXY_FREE_PORTS"


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _port_range() -> tuple[int, int]:
    low, _, high = os.environ.get(PORT_RANGE_ENV, "").partition("-")
    if low.isdigit() and high.isdigit() and 0 < int(low) < int(high) < 65_536:
        return int(low), int(high)
    return _PORTS_FLOOR, _ephemeral_floor()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range where there is room (or in
    ``$TIERPROXY_FREE_PORTS``): a port the kernel hands out for ``bind(0)`` is the kind it also
    gives every outgoing connection, so a client elsewhere could take it before the server that
    was meant to bind it does."""
    floor, ceiling = _port_range()
    for _ in range(64) if ceiling - floor >= 1_000 else ():
        port = random.randrange(floor, ceiling)
        if port in _GIVEN:
            continue  # handed out lately, maybe not bound yet (a test's two listeners got one)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _GIVEN.append(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_GIVEN: collections.deque[int] = collections.deque(maxlen=256)  # free_port's latest answers


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux: each thread's ``children`` list in /proc)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    children = Path(f"/proc/{current}/task/{task}/children").read_text()
                    todo += [int(child) for child in children.split()]
    return tree


def confine_tree(pid: int, cpus: frozenset[int]) -> int:
    """Every thread of ``pid`` and of its descendants onto ``cpus`` (threads they start later
    inherit it); how many were moved. Affinity is per thread on Linux: a process's own call
    moves only the thread that makes it."""
    moved = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{member}/task"):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task), cpus)
                    moved += 1
    return moved
