"""Shared fixtures: real stock vLLM servers (CPU build, tiny model) started by the suite.

Engines are started once per distinct setting and shared across tests; at most
``MAX_LIVE_ENGINES`` (4) run at once (each holds ~3 GB; the suite needs 4), the least recently used one is stopped
to make room. Every engine logs to a file; when a test fails, the tails of the logs of the
engines it used are printed. All engines are stopped by PID at the end, also on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path

import pytest

from proxy.ops.engine import EngineProcess, EngineSpec, engine_cores, free_port, spread_cores, tail

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO / ".tierproxy" / "tiny-model"
MAX_LIVE_ENGINES = int(os.environ.get("TIERPROXY_TEST_MAX_ENGINES", "4"))


def _engines_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


class EngineFarm:
    """Starts and caches real vLLM servers keyed by their settings."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.live: OrderedDict[tuple[object, ...], EngineProcess] = OrderedDict()
        self.used_by_current_test: list[EngineProcess] = []
        self.started = 0
        # (setting name, seconds from start to ready) per engine started: the suite's main cost.
        self.starts: list[tuple[str, float]] = []

    def model_dir(self) -> Path:
        from proxy.ops.tiny_model import make_tiny_model

        return make_tiny_model(TINY_MODEL_DIR)

    def get(
        self,
        name: str,
        *,
        max_num_seqs: int = 4,
        plugin: bool = False,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> EngineProcess:
        key = (name, max_num_seqs, plugin, tuple(extra_args), tuple(sorted((env or {}).items())))
        engine = self.live.get(key)
        if engine is not None and (fresh or not engine.alive()):
            engine.stop()
            del self.live[key]
            engine = None
        if engine is None:
            while len(self.live) >= MAX_LIVE_ENGINES:
                _, oldest = self.live.popitem(last=False)
                oldest.stop()
            spec = EngineSpec(
                port=free_port(),
                model=str(self.model_dir()),
                served_name="tiny",
                max_num_seqs=max_num_seqs,
                plugin=plugin,
                extra_args=extra_args,
                env=env or {},
                cpu_bind=spread_cores(self.started),
                cpus=engine_cores(),  # off the core of this process, which runs the proxy
            )
            self.started += 1
            t0 = time.monotonic()
            engine = EngineProcess(spec, self.log_dir / f"vllm-{name}-{spec.port}.log").start()
            self.live[key] = engine
            engine.wait_ready()
            self.starts.append((name, time.monotonic() - t0))
        self.live.move_to_end(key)
        self.used_by_current_test.append(engine)
        return engine

    def stop_all(self) -> None:
        while self.live:
            _, engine = self.live.popitem()
            engine.stop()


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFarm]:
    if not _engines_available():
        pytest.fail("vLLM is not installed: run `make test`, which installs the engine extra")
    # Not under pytest's basetemp: concurrent pytest runs prune each other's basetemp dirs.
    log_dir = REPO / ".tierproxy" / "test-logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    farm = EngineFarm(log_dir)
    atexit.register(farm.stop_all)  # also on interpreter exit after Ctrl-C
    try:
        yield farm
    finally:
        farm.stop_all()
        _report_starts(farm)


def _report_starts(farm: EngineFarm) -> None:
    lines = [f"{name}\t{seconds:.1f}" for name, seconds in farm.starts]
    total = sum(seconds for _, seconds in farm.starts)
    summary = f"vLLM engine starts: {len(farm.starts)}, {total:.0f} s to ready in all"
    farm.log_dir.mkdir(parents=True, exist_ok=True)
    (farm.log_dir / "starts.tsv").write_text("\n".join([*lines, summary, ""]))
    print(f"\n{summary} ({farm.log_dir / 'starts.tsv'})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    farm = _farm_of(item)
    if farm is None:
        return report
    if report.failed:
        for engine in farm.used_by_current_test:
            if engine.log_path is not None:
                report.sections.append(
                    (f"vLLM log tail ({engine.spec.url})", tail(engine.log_path, 60))
                )
    if report.when == "teardown":
        farm.used_by_current_test.clear()
    return report


def _farm_of(item: pytest.Item) -> EngineFarm | None:
    funcargs = getattr(item, "funcargs", {})
    farm = funcargs.get("engines")
    return farm if isinstance(farm, EngineFarm) else None


def _dump_asyncio_tasks(signum: int, frame: object) -> None:
    """`kill -USR1 <pytest pid>` prints every asyncio task's stack: for diagnosing a hang."""
    import asyncio
    import sys

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    tasks = asyncio.all_tasks(loop) if loop is not None else set()
    for task in tasks:
        print(f"--- {task.get_name()}: {task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


def pytest_configure(config: pytest.Config) -> None:
    import signal

    signal.signal(signal.SIGUSR1, _dump_asyncio_tasks)
