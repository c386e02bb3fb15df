"""A real redis-server on a free loopback port, for the shared-state tests and benchmark: no
persistence by default (a restart is a Redis that forgot everything, the harshest case);
``appendonly`` keeps every write (fsync each), as docs/quotas.md advises where budgets are money."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from proxy.ops.process import free_port


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "always",
                "--dir",
                str(self.workdir),
                # DEBUG SLEEP from loopback: a test's stall of the whole server (a fork, an fsync)
                "--enable-debug-command",
                "local",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: connections drop at once, nothing is saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
