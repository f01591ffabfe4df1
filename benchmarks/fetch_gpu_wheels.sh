#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into .whl/ (git-ignored): the pinned reference stack
# (transformers, tokenizers, peft), the optional fast kernels (fla-core), and what the project
# needs beyond the machine's image: jsonschema and its dependencies (the exporter's manifest check),
# valen-serve's HTTP stack, pyspng (the fast PNG decoder), PyAV (the video decoder: 41 MB of the
# ≈ 57 MB, which with the tracked tree stays under the device tool's 64 MiB carry) and pytest-xdist
# (the gpu-marked tests run in parallel processes); built for CPython 3.12 on x86-64 Linux.
# Run it here, where PyPI is reachable; benchmarks/gpu_run.sh installs them there.
# Extra NAME==VERSION arguments are fetched too.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
pinned=("transformers==5.4.0" "tokenizers==0.22.2" "peft==0.18.1" "fla-core==0.6.0"
        "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==2026.9.1"
        "uvicorn==0.54.0" "starlette==1.10.0" "h11==0.16.0" "anyio==4.16.0" "pyspng==0.1.4"
        "pytest-xdist==3.8.0" "execnet==2.1.2" "av==16.1.0")
for spec in "${pinned[@]}" "$@"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" || { echo "fetch_gpu_wheels: could not download $spec (is PyPI reachable?)" >&2; exit 1; }
done
ls -1 .whl
