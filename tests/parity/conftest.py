"""Parity test fixtures: the reference (bf16, the fp32 truth, fp64) on the control requests, run
once per session in parallel processes and cached, shared by the CLI tests (through
--reference-cache) and the negative controls (in process).

The session fixtures `tiny_fixture` / `tiny_export` come from tests/conftest.py.
"""

from __future__ import annotations

import pytest

# The pinned reference stack (transformers, peft, torchvision) is a hard requirement here: `make test`
# installs it, and a skip would silently drop every reference comparison.
from parity import cases, controls, generator
from parity.reference_run import start_reference

from ..conftest import run_wide

THREADS = 1
CONTROL_REQUESTS = 3  # per control; their union is the session's request set


@pytest.fixture(scope="session")
def all_cases():
    return cases.cases("all")


@pytest.fixture(scope="session")
def control_requests():
    """The first CONTROL_REQUESTS requests of the CI set that exercise each control, in set order."""
    ci = generator.ci_set()
    chosen = {f"{c}/{n}" for control in controls.CONTROLS for c, n, _ in controls.subset(control, ci, CONTROL_REQUESTS)}
    return [(c, n, r) for c, n, r in ci if f"{c}/{n}" in chosen]


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory):
    """One cache for the whole run (every xdist worker's sessions)."""
    with run_wide(tmp_path_factory, "parity-reference-cache") as (directory, _):
        return directory


@pytest.fixture(scope="session")
def references(tiny_fixture, control_requests, reference_cache, tmp_path_factory):
    """{dtype: ReferenceRun} of the control requests: bf16, fp32 (the truth) and fp64. The first
    xdist worker to need them runs the reference processes into the run's cache; the others wait
    for it and read the cache (no second set of processes)."""
    ids = [(f"{c}/{n}", r) for c, n, r in control_requests]
    with run_wide(tmp_path_factory, "parity-references") as _:
        jobs = {d: start_reference(tiny_fixture.checkpoint, tiny_fixture.base, ids, device="cpu", dtype=d, threads=THREADS, cache_dir=reference_cache)
                for d in ("bf16", "fp32", "fp64")}
        return {d: job.wait() for d, job in jobs.items()}
