# `make demo` and `make test` work on a fresh machine with Python 3.11: they build .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED := 0

.PHONY: demo test fuzz test-fast test-slow parity-gate gpu-wheels clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m valen_export.demo build/demo

# Hypothesis runs derandomized with no example database in tests (profile "ci", tests/conftest.py).
test: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -m "not gpu" tests
	$(MAKE) parity-gate

# Random search for people hunting bugs: the same properties, many more examples, failures kept
# in .hypothesis/ and replayed first on the next `make fuzz`.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -m "hypothesis and not gpu" tests

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -m "not gpu and not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow" tests

# The CI parity gate: tiny fixture, both LoRA modes, fp32 and bf16, every built-in case.
parity-gate: $(STAMP)
	$(BIN)/python -m parity.gate build/parity-gate

# Wheels the GPU machine lacks (pinned reference stack + fla-core), into .whl/ for benchmarks/gpu_run.sh.
gpu-wheels:
	bash benchmarks/fetch_gpu_wheels.sh

clean:
	rm -rf build .pytest_cache .hypothesis
