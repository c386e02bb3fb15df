#!/usr/bin/env bash
# Local base images for building where no image registry can be reached (as on the machine that
# runs the compose test): Debian bookworm from Debian's archive with debootstrap, imported
# (tierproxy-debian:bookworm), and Debian's python3 on it (tierproxy-python:3.11-bookworm), to
# pass as BASE_IMAGE. Images already there are kept. Needs root, debootstrap and a docker daemon.
#   docker/base.sh [MIRROR]        (default: http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."
MIRROR=${1:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}
if ! "$DOCKER" image inspect tierproxy-debian:bookworm >/dev/null 2>&1; then
	root=$(mktemp -d)
	trap 'rm -rf "$root"' EXIT
	debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
	rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
	tar -C "$root" -c . | "$DOCKER" import - tierproxy-debian:bookworm >/dev/null
fi
if ! "$DOCKER" image inspect tierproxy-python:3.11-bookworm >/dev/null 2>&1; then
	DOCKER_BUILDKIT=0 "$DOCKER" build -q -t tierproxy-python:3.11-bookworm \
		-f docker/base-python.Dockerfile docker >/dev/null
fi
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' tierproxy-debian
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' tierproxy-python
