"""The CPU compose stack (docker/test/compose.cpu.yml) under a project name of its own, driven
with Debian's docker-compose: up, wait for health, addresses, signals, down, what is left."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.dockerd import DockerUnavailable, docker_cli, run
from tests.helpers.paths import REPO

COMPOSE_FILE = REPO / "docker" / "test" / "compose.cpu.yml"
SERVICES = ("vllm-0", "vllm-1", "redis", "proxy", "proxy-2", "haproxy", "prometheus")
HEALTHCHECKED = ("vllm-0", "vllm-1", "redis", "proxy", "proxy-2")
ENGINES = ("vllm-0", "vllm-1")


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    log: Path
    _ips: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 120) -> str:
        cmd = ["docker-compose", "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        done = run(cmd, timeout=timeout, env=dict(os.environ, **self.env))
        with self.log.open("a") as out:
            out.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}\n")
        if done.returncode != 0:
            # compose's "ERROR: ..." line says why (a container unhealthy), its last one only
            # that there were errors.
            lines = done.stderr.strip().splitlines() or ["?"]
            last = next((line for line in lines if line.startswith("ERROR")), lines[-1])
            raise AssertionError(f"docker-compose {args[0]} failed ({self.log}): {last}")
        return done.stdout

    def up(self, ready_s: float) -> None:
        # Returns once the engines and Redis are healthy (the proxies depend on them).
        try:
            self.compose("up", "-d", "--no-build", timeout=ready_s)
        except AssertionError:
            self.compose("logs", "--tail=40")  # into the log the message names
            raise
        self.wait_healthy(HEALTHCHECKED, ready_s)
        self.confine_engines()

    def confine_engines(self, engines: tuple[str, ...] = ENGINES, cpus: str = "") -> None:
        """Ready engines onto their cores (docker/test/compose.cpu.yml: ENGINE_CPUS), or onto
        ``cpus``."""
        cpus = cpus or self.env.get("ENGINE_CPUS", "0")
        for engine in engines:
            cmd = [docker_cli(), "update", "--cpuset-cpus", cpus, self.container(engine)]
            assert run(cmd, timeout=30).returncode == 0, cmd

    def restart_engine(self, engine: str, ready_s: float) -> None:
        """Start a stopped engine's container again, as `up` started it: its imports on every
        core, confined once ready. (The container keeps its cpuset: started confined, its
        imports shared one core with the other engine's spinning under load, over 5 min.)"""
        every_core = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        self.confine_engines((engine,), every_core)
        self.compose("start", engine)
        self.wait_healthy((engine,), ready_s)
        self.confine_engines((engine,))

    def wait_healthy(self, services: tuple[str, ...], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while (states := {s: self.health(s) for s in services}) and any(
            v != "healthy" for v in states.values()
        ):
            if time.monotonic() > deadline or {"exited", "dead"} & set(states.values()):
                self.compose("logs", "--tail=30")
                raise AssertionError(f"not healthy in {within_s:.0f} s: {states} (see {self.log})")
            time.sleep(1)
        self._ips.clear()

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def health(self, service: str) -> str:
        cid = self.container(service)
        if not cid:
            return "missing"
        fmt = (
            '{{if ne .State.Status "running"}}{{.State.Status}}'
            "{{else if .State.Health}}{{.State.Health.Status}}{{else}}running{{end}}"
        )
        return run([docker_cli(), "inspect", "-f", fmt, cid], timeout=30).stdout.strip()

    def url(self, service: str, port: int) -> str:
        """The service's address on the stack's internal network, reached from the host
        through the network's bridge (no port is published)."""
        if service not in self._ips:
            cid = self.container(service)
            fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
            ip = run([docker_cli(), "inspect", "-f", fmt, cid], timeout=30).stdout.strip()
            assert ip, f"{service} has no address: {self.health(service)} (see {self.log})"
            self._ips[service] = ip
        return f"http://{self._ips[service]}:{port}"

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of the project still there."""
        label = f"label=com.docker.compose.project={self.project}"
        left: list[str] = []
        for kind in ("container", "network", "volume"):
            cmd = [docker_cli(), kind, "ls", "-q", "--filter", label]
            if kind == "container":
                cmd.insert(3, "-a")
            left += [f"{kind} {ident}" for ident in run(cmd, timeout=30).stdout.split()]
        return left


def memory_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(gb: float, within_s: float) -> None:
    """Two engine containers are ~3 GB each: wait for room rather than starve the machine."""
    deadline = time.monotonic() + within_s
    while (free := memory_available_gb()) < gb:
        if time.monotonic() > deadline:
            raise DockerUnavailable(f"only {free:.1f} GB of memory available, {gb} needed")
        time.sleep(5)


def describe(sizes: dict[str, int]) -> str:
    return json.dumps({tag: f"{n / 1e6:.0f} MB" for tag, n in sizes.items()})
