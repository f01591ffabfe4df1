"""Parity test fixtures: one bf16 reference run of every built-in case per session, shared by the
CLI tests (through --reference-cache) and the negative controls (in-process).

The session fixtures `tiny_fixture` / `tiny_export` come from tests/conftest.py.
"""

from __future__ import annotations

import pytest

# The pinned reference stack (transformers, peft, torchvision) is a hard requirement here: `make test`
# installs it, and a skip would silently drop every reference comparison.
from parity import cases, harness

THREADS = 1


@pytest.fixture(scope="session")
def all_cases():
    return cases.cases("all")


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("parity-reference-cache")


@pytest.fixture(scope="session")
def bf16_reference(tiny_fixture, all_cases, reference_cache):
    """The reference (separate process, rebuilt from checkpoint.pt + base) on every built-in case, bf16, CPU."""
    return harness.run_reference(
        tiny_fixture.checkpoint,
        tiny_fixture.base,
        [(f"{c}/{n}", r) for c, n, r in all_cases],
        device="cpu",
        dtype="bf16",
        threads=THREADS,
        cache_dir=reference_cache,
    )
