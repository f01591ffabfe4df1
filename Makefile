# `make demo` and `make test` work on a fresh machine with Python 3.11: they build .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED := 0

.PHONY: demo test test-fast test-slow parity-gate gpu-wheels clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m valen_export.demo build/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests
	$(MAKE) parity-gate

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow" tests

# The CI parity gate: tiny fixture, both LoRA modes x fp32/bf16 x per-branch, shared-prefix and the fast kernels, the generated CI set (docs/parity.md).
parity-gate: $(STAMP)
	$(BIN)/python -m parity.gate build/parity-gate

# Wheels the GPU machine lacks (pinned reference stack + fla-core), into .whl/ for benchmarks/gpu_run.sh.
gpu-wheels:
	bash benchmarks/fetch_gpu_wheels.sh

clean:
	rm -rf build .pytest_cache .hypothesis
