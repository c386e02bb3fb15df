"""The compose stack as an operator runs it (`make compose-test`, not `make test`): a Docker
daemon (started here when none runs, and stopped again), the images built offline, the CPU
stack up and healthy; after the tests, `down` and a check that nothing is left: no container,
network or volume of the project, and no rule or setting of a daemon started here.

A machine where this cannot run (no Docker and no apt, a daemon that does not start, too
little memory) stops the session with one line saying why.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from proxy.tools.engine import engine_cores
from tests.helpers.compose_stack import Stack, describe, wait_for_memory
from tests.helpers.docker_images import build_all
from tests.helpers.dockerd import Dockerd, DockerUnavailable
from tests.helpers.paths import REPO, TINY_MODEL_DIR

CONFIG_TEMPLATE = REPO / "docker" / "test" / "compose-test.yaml"
ENGINE_MEMORY_GB = 7.0  # two engines of ~3 GB each, and room to spare


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Left out unless chosen with `-m compose` (the make target does)."""
    if "compose" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the compose stack runs under `make compose-test`")
    for item in items:
        if item.get_closest_marker("compose"):
            item.add_marker(skip)


class Keys:
    """The tenants' keys of one run, and a second key of chat-app that a test revokes."""

    def __init__(self) -> None:
        self.high, self.normal, self.low, self.revocable = (
            f"tp-{secrets.token_urlsafe(24)}" for _ in range(4)
        )
        self.secret = secrets.token_urlsafe(32)


def write_config(folder: Path, keys: Keys, *, revoked: bool) -> None:
    """The stack's config: the template plus chat-app's second key unless ``revoked``; renamed
    over the old file as editors and `tierproxy keys` do."""
    config = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    if not revoked:
        digest = hashlib.sha256(keys.revocable.encode()).hexdigest()
        config["tenants"][0]["keys"].append({"sha256": digest})
    staged = folder / ".compose-test.yaml.new"
    staged.write_text(yaml.safe_dump(config, sort_keys=False))
    staged.chmod(0o644)
    staged.rename(folder / "compose-test.yaml")


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="session")
def config_dir(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Path:
    folder = tmp_path_factory.mktemp("compose-config")
    folder.chmod(0o755)  # the proxy runs as uid 10001 in its container
    write_config(folder, keys, revoked=False)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, readable by the engines' unprivileged user (safetensors are written 0600)."""
    folder = tmp_path_factory.mktemp("compose-model") / "tiny"
    shutil.copytree(TINY_MODEL_DIR, folder)
    for path in (folder, *folder.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="session")
def stack(
    request: pytest.FixtureRequest, config_dir: Path, model_dir: Path, keys: Keys
) -> Iterator[Stack]:
    report = Reporter(request.config)
    logs = REPO / ".tierproxy" / "test-logs" / f"compose-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        "TIERPROXY_CONFIG_DIR": str(config_dir),
        "TINY_MODEL_DIR": str(model_dir),
        "ENGINE_CPUS": ",".join(map(str, sorted(engine_cores() or {0}))),
        "TIERPROXY_TICKET_SECRET": keys.secret,
        "CHAT_APP_KEY": keys.high,
        "WEB_APP_KEY": keys.normal,
        "BATCH_KEY": keys.low,
    }
    try:
        with Dockerd(logs / "dockerd.log") as daemon:
            started = time.monotonic()
            sizes = build_all()
            report(f"images built in {time.monotonic() - started:.0f} s: {describe(sizes)}")
            wait_for_memory(ENGINE_MEMORY_GB, within_s=600)
            stack = Stack(f"tierproxytest{int(time.time())}", env, logs / "compose.log")
            try:
                started = time.monotonic()
                stack.up(ready_s=600)
                report(f"stack healthy in {time.monotonic() - started:.0f} s")
                yield stack
            finally:
                stack.down()
                left = stack.leftovers()
        changes = daemon.host_changes()
    except DockerUnavailable as exc:
        pytest.exit(f"compose test cannot run here: {exc}", returncode=1)
    assert not left, f"left after down: {left}"
    assert not changes, f"the daemon started here left: {changes}"


class Reporter:
    """Lines on pytest's terminal as the run goes (not captured), and in the summary."""

    def __init__(self, config: pytest.Config) -> None:
        self.terminal = config.pluginmanager.get_plugin("terminalreporter")
        self.capture = config.pluginmanager.get_plugin("capturemanager")

    def __call__(self, line: str) -> None:
        if self.terminal is None:
            return
        # Written inside a fixture or test, the line went to the captured output, shown only
        # when that test failed: the figures of a passing run were lost.
        if self.capture is None:
            self.terminal.write_line(f"[compose] {line}")
            return
        with self.capture.global_and_fixture_disabled():
            self.terminal.write_line(f"[compose] {line}")
