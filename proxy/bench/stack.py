"""A local stack for a benchmark: one stock vLLM (tiny CPU model by default) and the proxy.

The proxy runs as its own process (`python -m proxy.cli serve`), as it would in production, so
that it does not share an event loop or a core with the load generator.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Self

from proxy.bench.proxy_config import proxy_config, write_proxy_config
from proxy.bench.scenario import Scenario
from proxy.ops.process import ManagedProcess, StopOnExit, free_port, http_ok
from proxy.ticket import DEFAULT_SECRET_ENV
from proxy.tools.engine import EngineProcess, local_engine


class LocalStack(StopOnExit):
    def __init__(
        self,
        scenario: Scenario,
        out_dir: Path,
        *,
        model: str | None = None,
        max_num_seqs: int = 4,
        max_inflight: int | None = 4,
        plugin: bool = True,
        early_refusal: bool = False,
        engine_args: list[str] | None = None,
    ) -> None:
        self.scenario = scenario
        self.out_dir = out_dir
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_inflight = max_inflight
        self.early_refusal = early_refusal
        self.plugin = plugin
        self.engine_args = engine_args or []
        self.engine: EngineProcess | None = None
        self.proxy: ProxyProcess | None = None
        self.proxy_port = 0
        self.served_name = ""
        self.config_path = out_dir / "proxy.yaml"

    @property
    def engine_url(self) -> str:
        assert self.engine is not None
        return self.engine.spec.url

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start(self, ready_timeout_s: float = 300.0) -> LocalStack:
        env_name = DEFAULT_SECRET_ENV
        secret = os.environ.get(env_name) or secrets.token_urlsafe(32)
        # Confined: the last core stays for the proxy and the load generator.
        spec = local_engine(
            model=self.model,
            max_num_seqs=self.max_num_seqs,
            plugin=self.plugin,
            extra_args=self.engine_args,
            env={env_name: secret},
        )
        self.served_name = spec.served_name or spec.model
        self.engine = EngineProcess(spec, self.out_dir / "vllm.log")
        print(f"starting vLLM on {spec.url} (log {self.engine.log_path})", file=sys.stderr)
        self.engine.start().wait_ready(ready_timeout_s)

        self.proxy_port = free_port()
        data = proxy_config(
            self.scenario,
            [spec.url],
            port=self.proxy_port,
            max_inflight=self.max_inflight,
            early_refusal=self.early_refusal,
        )
        write_proxy_config(data, self.config_path, self.scenario)
        self.proxy = ProxyProcess(
            self.config_path, self.proxy_port, self.out_dir / "proxy.log", env={env_name: secret}
        )
        print(
            f"starting the proxy on {self.proxy_url} (config {self.config_path},"
            f" log {self.proxy.log_path})",
            file=sys.stderr,
        )
        self.proxy.start()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.engine is not None:
            self.engine.stop()
            self.engine = None


class ProxyProcess(ManagedProcess):
    """`python -m proxy.cli serve -c CONFIG` in its own process group, up when /healthz is."""

    def __init__(
        self, config_path: Path, port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        environment = {**os.environ, **(env or {})}
        environment.setdefault(DEFAULT_SECRET_ENV, secrets.token_urlsafe(32))
        super().__init__(
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "serve",
                "-c",
                str(config_path),
                "--port",
                str(port),
            ],
            env=environment,
            log_path=log_path,
            name="the proxy",
        )
        self.config_path = config_path
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> Self:
        super().start()
        try:
            self.wait_until(
                lambda: http_ok(f"{self.url}/healthz", timeout_s=2.0),
                ready_timeout_s,
                "/healthz answering",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
