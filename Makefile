# `make demo` and `make test` work on a fresh machine with Python 3.11: they build .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED := 0
# Bytecode caches on (an empty value), also where the environment turns them off: the test run
# starts dozens of Python processes, and each would otherwise recompile and re-rewrite the same
# modules (about 20 CPU-seconds of `make test`).
export PYTHONDONTWRITEBYTECODE :=

# The native check (docs/export-format.md): the Rust reader in native/, built the usual way from
# crates.io, or offline from Debian's packaged crates when they are installed (make native-deps;
# native/README.md). cargo is often only in rustup's ~/.cargo/bin, so look there too. `make test`
# skips the Rust side with one line when it cannot be built; CARGO= simulates a machine without cargo.
CARGO ?= $(shell command -v cargo 2>/dev/null || (test -x $(HOME)/.cargo/bin/cargo && echo $(HOME)/.cargo/bin/cargo))
DEBIAN_CRATES ?= /usr/share/cargo/registry
export VALEN_CARGO := $(CARGO)
export VALEN_DEBIAN_CRATES := $(DEBIAN_CRATES)
NATIVE_DEBS := librust-serde-json-dev librust-sha2-dev librust-memmap2-dev librust-half-dev
NATIVE_NO_CARGO := cargo not found; install Rust (README.md, section Check an export natively)

.PHONY: demo test fuzz test-fast test-slow parity-gate gpu-wheels clean native-deps native-build native-check

# --no-compile: pip would byte-compile every installed module (a quarter of the install, most of them
# never imported); Python writes the bytecode of those imported on first use instead.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing requirements.txt into $(VENV) (torch and the pinned reference stack): 3-5 minutes the first time, mostly downloads."
	$(BIN)/pip install --no-compile --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The exporter's half builds and verifies both exports and writes two requests; valen-run answers them.
demo: $(STAMP)
	$(BIN)/python -m valen_export.demo build/demo
	@for kind in text image; do echo "5. valen-run --export build/demo/export-separate build/demo/$$kind-request.json"; \
	  $(BIN)/valen-run --export build/demo/export-separate build/demo/$$kind-request.json || exit 1; done
	@echo "Random weights: the answers show the pipeline works, not what the real model would say."
	@echo "Next: the README's example requests, answered by valen-run --export build/demo/export-separate"

# Hypothesis runs derandomized with no example database in tests (profile "ci", tests/conftest.py).
# The suite runs in TEST_WORKERS pytest-xdist processes (default: one per core), each on one torch
# thread: most tests are single-threaded compiles, subprocesses and waits, and a second thread per
# process only spins against the other worker. Inductor compiles inside the worker: its default pool
# would start a process per core, each importing torch, for compiles one worker runs in turn
# (the tests marked `inductor` run first, in one worker: tests/conftest.py).
# The parity gate runs beside them at a lower priority (nice 10), on one torch thread too (a second
# one spun against the tests: a third more CPU for the same gate): it takes the cores the tests
# leave idle (their tail, their waits on subprocesses) and gets the rest once they are done.
TEST_WORKERS ?= auto
PYTEST := OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal
test: $(STAMP)
	@mkdir -p build; echo "parity gate: started beside the tests at nice 10 (its log follows them; build/parity-gate.log)"
	@OMP_NUM_THREADS=1 nice -n 10 $(BIN)/python -m parity.gate build/parity-gate > build/parity-gate.log 2>&1 & gate=$$!; \
	  $(PYTEST) -m "not gpu" tests; tests=$$?; \
	  wait $$gate; gated=$$?; cat build/parity-gate.log; \
	  test $$tests = 0 && test $$gated = 0

# Random search for people hunting bugs: the same properties, many more examples, failures kept
# in .hypothesis/ and replayed first on the next `make fuzz`.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -m "hypothesis and not gpu" tests

test-fast: $(STAMP)
	$(PYTEST) -m "not gpu and not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m "slow" tests

# The CI parity gate: tiny fixture, both LoRA modes x fp32/bf16 x per-branch, shared-prefix and the fast kernels, the generated CI set (docs/parity.md).
parity-gate: $(STAMP)
	$(BIN)/python -m parity.gate build/parity-gate

# Wheels the GPU machine lacks (pinned reference stack + fla-core), into .whl/ for benchmarks/gpu_run.sh.
gpu-wheels:
	bash benchmarks/fetch_gpu_wheels.sh

# Debian's Rust crate sources (into /usr/share/cargo/registry); needs root. With them installed, the
# native targets and tests build offline from them instead of crates.io.
native-deps:
	@dpkg -s $(NATIVE_DEBS) >/dev/null 2>&1 && echo "native-deps: $(NATIVE_DEBS) already installed" || { \
	  apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(NATIVE_DEBS); }

# native/target/release/valen-native-check, with the committed Cargo.lock: offline from Debian's
# crates when $(DEBIAN_CRATES) exists (the opt-in: native/offline/), else from crates.io.
native-build:
	@test -n "$(CARGO)" || { echo "native-build: $(NATIVE_NO_CARGO)" >&2; exit 1; }
	@if test -d $(DEBIAN_CRATES); then \
	  echo "native-build: crates from Debian's packages in $(DEBIAN_CRATES), offline"; \
	  $(PYTHON) native/offline/debian_crates.py --from $(DEBIAN_CRATES) && \
	  $(CARGO) build --release --locked --config native/offline/debian.toml --manifest-path native/Cargo.toml; \
	else \
	  echo "native-build: crates from crates.io ($(DEBIAN_CRATES) absent)"; \
	  $(CARGO) build --release --locked --manifest-path native/Cargo.toml; \
	fi

# Build valen-native-check and run it on fresh tiny exports (both LoRA modes, with vectors) and on
# damaged ones; fails (never skips) when it cannot be built or when no Rust reader test ran.
native-check: $(STAMP) native-build
	VALEN_NATIVE_REQUIRED=1 $(BIN)/python -m pytest -q tests/native

clean:
	rm -rf build .pytest_cache .hypothesis
