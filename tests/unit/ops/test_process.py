"""ManagedProcess: one stop path for a whole process group, a log, death with the parent."""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import proxy
from proxy.ops import process
from proxy.ops.process import (
    PORT_RANGE_ENV,
    ManagedProcess,
    confine_tree,
    free_port,
    process_tree,
    tail,
)

# Forks a grandchild that would outlive a plain kill of its parent, prints both pids.
FAMILY = """
import os, signal, time
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie of an exited child counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_stop_ends_the_whole_group_even_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "family.log"
    proc = ManagedProcess([sys.executable, "-c", FAMILY], log_path=log).start()
    try:
        assert _wait_for(lambda: len(log.read_text().split()) == 2)
        parent, child = (int(p) for p in log.read_text().split())
        assert proc.pid == parent and proc.alive()
        assert os.getpgid(child) == parent  # its own group, led by the process itself
    finally:
        proc.stop(grace_s=5.0)
    assert not proc.alive()
    assert _wait_for(lambda: _gone(child))
    proc.stop()  # idempotent


def test_wait_until_reports_an_early_exit_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "early.log"
    proc = ManagedProcess(
        [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
        log_path=log,
        name="the thing",
    ).start()
    with pytest.raises(RuntimeError, match="the thing exited before ready") as exc:
        proc.wait_until(lambda: False, timeout_s=30.0, what="ready", poll_s=0.01)
    assert "bad flag" in str(exc.value) and "bad flag" in tail(log)
    proc.stop()


def test_wait_until_times_out_and_cpus_confine_the_child(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    script = "import os, time; print(sorted(os.sched_getaffinity(0)), flush=True); time.sleep(60)"
    log = tmp_path / "cpus.log"
    with ManagedProcess(
        [sys.executable, "-c", script], log_path=log, cpus=frozenset({core})
    ) as proc:
        proc.start()
        with pytest.raises(TimeoutError):
            proc.wait_until(lambda: False, timeout_s=0.05, what="never", poll_s=0.01)
        assert _wait_for(lambda: log.read_text().strip() == f"[{core}]")
    assert not proc.alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    # A middle process starts a ManagedProcess, prints its pid, and is killed hard.
    middle = """
import sys, time
from proxy.ops.process import ManagedProcess
p = ManagedProcess([sys.executable, "-c", "import time; time.sleep(600)"]).start()
print(p.pid, flush=True)
time.sleep(600)
"""
    log = tmp_path / "middle.log"
    repo = str(Path(proxy.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    outer = ManagedProcess([sys.executable, "-c", middle], env=env, log_path=log).start()
    try:
        assert _wait_for(lambda: log.read_text().strip().isdigit())
        grandchild = int(log.read_text())
        assert outer.proc is not None
        os.kill(outer.proc.pid, signal.SIGKILL)  # only the middle process, not its group
        assert _wait_for(lambda: _gone(grandchild))
    finally:
        outer.stop()


# A child that starts a thread and a grandchild, prints the grandchild's pid, then waits.
THREADED_FAMILY = """
import os, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
time.sleep(600)
"""


def _allowed(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid``."""
    return {frozenset(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_confine_tree_moves_every_thread_of_every_descendant(tmp_path: Path) -> None:
    core = frozenset({min(os.sched_getaffinity(0))})
    log = tmp_path / "family.log"
    with ManagedProcess([sys.executable, "-c", THREADED_FAMILY], log_path=log) as proc:
        proc.start()
        assert _wait_for(lambda: log.read_text().strip().isdigit())
        grandchild = int(log.read_text())
        assert proc.pid is not None and grandchild in process_tree(proc.pid)
        moved = confine_tree(proc.pid, core)
        assert moved >= 3  # the child's two threads, the grandchild's one
        assert _allowed(proc.pid) == {core} and _allowed(grandchild) == {core}


def test_free_port_stays_out_of_the_range_outgoing_connections_take() -> None:
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    if floor >= 11_000:
        assert all(10_000 <= port < floor for port in ports)
    for port in ports:  # each one binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_draws_from_the_range_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-21999")
    assert all(20_000 <= free_port() < 21_999 for _ in range(20))
    monkeypatch.setenv(PORT_RANGE_ENV, "not-a-range")  # ignored: the default range
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if floor >= 11_000:
        assert all(10_000 <= free_port() < floor for _ in range(20))


def test_free_port_never_hands_out_a_port_twice_before_it_is_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A test asks for its proxy's port and its admin listener's before either binds: the same
    draw twice made the second listener fail (address already in use)."""
    first, second = sorted(_kernel_ports(2))  # free now, whatever else runs beside the test
    monkeypatch.setenv(PORT_RANGE_ENV, f"{first}-{second + 1_000}")
    monkeypatch.setattr(process, "_GIVEN", collections.deque(maxlen=256))  # none handed out yet
    draws = iter([first, first, second])
    monkeypatch.setattr(random, "randrange", lambda *_: next(draws))
    assert [free_port(), free_port()] == [first, second]


def _kernel_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
