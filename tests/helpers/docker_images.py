"""The compose test's images, built offline: a Debian base from Debian's archive (docker/base.sh),
wheelhouses from the host's index (docker/wheelhouse.sh), then the proxy, the CPU engine and the
stand-ins for the third-party images with the classic builder (BuildKit pulls its frontend).
Docker's layer cache makes a second run quick; the sizes are reported."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.dockerd import DockerUnavailable, docker_cli, run
from tests.helpers.paths import REPO

PYTHON_BASE = "tierproxy-python:3.11-bookworm"
DEBIAN_BASE = "tierproxy-debian:bookworm"


@dataclass(frozen=True)
class Image:
    tag: str
    dockerfile: str
    base: str
    wheels: str | None  # folder of build/wheels, None: the image installs no wheels
    context: str = "."


IMAGES = (
    Image("tierproxy:latest", "docker/proxy.Dockerfile", PYTHON_BASE, "build/wheels/proxy"),
    Image(
        "tierproxy-vllm-cpu:latest",
        "docker/vllm-cpu.Dockerfile",
        PYTHON_BASE,
        "build/wheels/engine",
    ),
    Image("tierproxy-standins:latest", "docker/standins.Dockerfile", DEBIAN_BASE, None, "docker"),
)


def _step(cmd: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> None:
    try:
        done = run(cmd, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        raise DockerUnavailable(f"{what}: no result in {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = (done.stderr + done.stdout).strip().splitlines() or ["?"]
        raise DockerUnavailable(f"{what} failed: {lines[-1]}")


def build_all() -> dict[str, int]:
    """Build every image (cached layers reused); their sizes in bytes by tag."""
    _step(["docker/base.sh"], "the Debian base images (docker/base.sh)", 900, _env())
    pip = str(Path(sys.executable).with_name("pip"))
    _step(["docker/wheelhouse.sh", "engine"], "the wheelhouse", 900, dict(_env(), PIP=pip))
    for image in IMAGES:
        cmd = [docker_cli(), "build", "-q", "-t", image.tag, "-f", image.dockerfile]
        cmd += ["--build-arg", f"BASE_IMAGE={image.base}"]
        if image.wheels:
            cmd += ["--build-arg", f"WHEELS={image.wheels}"]
        _step([*cmd, image.context], f"docker build {image.tag}", 1200, _env())
    return {image.tag: size(image.tag) for image in IMAGES}


def size(tag: str) -> int:
    done = run([docker_cli(), "image", "inspect", "--format", "{{.Size}}", tag], timeout=30)
    return int(done.stdout.strip() or 0)


def _env() -> dict[str, str]:
    # The classic builder: BuildKit would pull its frontend image, which cannot be had here.
    return dict(os.environ, DOCKER_BUILDKIT="0", COMPOSE_DOCKER_CLI_BUILD="0", DOCKER=docker_cli())
