"""A Docker daemon for the compose test: the one already running, or one started here and
stopped again with every trace of it undone.

dockerd changes the host as it starts: NAT and filter rules (its DOCKER chains, the FORWARD
policy set to DROP), `net.ipv4.ip_forward` turned on, a docker0 bridge. A daemon started here is
stopped by its PID and those three put back as they were, so that the machine is left as found.
Each step is bounded: a daemon that cannot start, or a machine where Docker cannot be installed,
is one line (``DockerUnavailable``), never a hang.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Self

from proxy.ops.process import StopOnExit

FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# The commands the compose test runs, and Debian's package of each: the daemon, the compose
# client, and debootstrap for the local base image (docker/base.sh).
PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
}


class DockerUnavailable(RuntimeError):
    """Why no daemon could be had, in one line."""


def run(
    cmd: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd, env=env
    )


def install_docker() -> None:
    """Debian's docker.io, docker-compose and debootstrap, those missing (root and apt only)."""
    missing = [package for command, package in PACKAGES.items() if shutil.which(command) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DockerUnavailable(
            f"no {'/'.join(missing)} here and no way to install them (needs root and apt-get:"
            f" apt-get install {' '.join(missing)})"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Another apt on the machine holds dpkg's lock for a while: wait for it, bounded.
    lock = ["-o", "DPkg::Lock::Timeout=120"]
    try:
        steps = (
            ["apt-get", *lock, "update", "-qq"],
            ["apt-get", *lock, "install", "-y", "-qq", *missing],
        )
        for step in steps:
            done = run(step, timeout=600, env=env)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise DockerUnavailable(f"`{' '.join(step)}` failed: {last}")
    except subprocess.TimeoutExpired:
        raise DockerUnavailable("apt-get did not finish in 10 minutes (no archive?)") from None


def docker_cli() -> str:
    """Debian's client, which matches its daemon; any other on PATH otherwise."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def daemon_answers() -> bool:
    try:
        return run([docker_cli(), "info", "--format", "{{.ID}}"], timeout=10).returncode == 0
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False


class Dockerd(StopOnExit):
    """``with Dockerd(log) as d:`` a daemon answers inside; ``d.started`` says whether it is
    ours (stopped on the way out, the host's network settings restored)."""

    def __init__(self, log: Path, ready_s: float = 30.0) -> None:
        self.log = log
        self.ready_s = ready_s
        self.started = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._rules: dict[str, str] = {}
        self._forward = ""
        self._had_bridge = False

    def __enter__(self) -> Self:
        install_docker()
        if daemon_answers():
            return self
        if os.geteuid() != 0:
            raise DockerUnavailable("no docker daemon answers, and starting one needs root")
        self._rules = {table: _save(table) for table in ("filter", "nat")}
        self._forward = FORWARD.read_text()
        self._had_bridge = Path("/sys/class/net/docker0").exists()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                ["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started = True
        deadline = time.monotonic() + self.ready_s
        while not daemon_answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
                raise DockerUnavailable(f"dockerd did not start ({self.log}): {tail[0]}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Stop the daemon we started (by PID: its containerd goes with it) and undo its
        changes to the host's network settings."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for rules in self._rules.values():
            subprocess.run(["iptables-restore"], input=rules, text=True, check=True, timeout=30)
        FORWARD.write_text(self._forward)
        if not self._had_bridge and Path("/sys/class/net/docker0").exists():
            run(["ip", "link", "delete", "docker0"], timeout=10)

    def host_changes(self) -> list[str]:
        """What our daemon left on the host after ``stop`` (empty: nothing)."""
        left = [
            f"iptables {t} differs"
            for t, r in self._rules.items()
            if _normal(_save(t)) != _normal(r)
        ]
        if self._forward and FORWARD.read_text() != self._forward:
            left.append("net.ipv4.ip_forward differs")
        if self.started and not self._had_bridge and Path("/sys/class/net/docker0").exists():
            left.append("the docker0 bridge is still there")
        return left


def _save(table: str) -> str:
    return subprocess.run(
        ["iptables-save", "-t", table], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def _normal(rules: str) -> str:
    """Rules without what changes by itself: comments (a date) and packet counters."""
    lines = (line for line in rules.splitlines() if not line.startswith("#"))
    return "\n".join(re.sub(r"\[\d+:\d+\]", "", line) for line in lines)
