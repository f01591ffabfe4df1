#!/usr/bin/env bash
# Everything this project measures on the GPU machine, in one call (device tool; see README "GPU set-up"):
#   run: bash benchmarks/gpu_run.sh   with carry [".whl"]; results land in $OUT.
# Steps (STEPS="tests latency parity" by default; "gate" runs the parity gate (below), "profile"
# benchmarks/profile_fast.py; each bounded so the call ends inside its 10-minute limit and writes what it has):
#   1. install the carried pinned stack into /tmp/site and fla-core into /tmp/site-fla (the
#      reference's process drops the latter from PYTHONPATH and blocks the import),
#   2. the gpu-marked tests (the fast path vs the reference modules, graphs vs direct execution;
#      TESTS_ARGS adds pytest options, e.g. -k NAME),
#   3. benchmarks/latency.py on the 2b preset (reference path vs runtime modes, one run; LATENCY_ARGS adds options, e.g. --skip-reference --only graphs),
#   4. valen-parity on the 2b preset: bf16 per-branch and shared-prefix, fp32 per-branch, both LoRA modes.
#   gate: the parity gate on the 2b preset (docs/parity.md): the generated 210-question set in the
#      default CUDA configuration for the exports in GATE_LORA (default both) with their fp32 dual
#      checks, and every negative control (each must fail); the truth-relative GPU tests beside it.
#      Work not started within BUDGET (default 560 s) is skipped and reported; the whole gate, both
#      exports with their controls, fits one call on one H200: GATE_LORA="separate merged"
#      GATE_SHARDS=4 GATE_TESTS=0 BUDGET=575 took 8.5 minutes (the reference processes are most of it).
#      GATE_ARGS adds gate options (e.g. "--set video"); GATE_CONTROLS=0 leaves the controls out.
#   "layers": benchmarks/layer_bench.py (LAYERS_ARGS adds options, e.g. --layer gdn --case c).
#   "variants": benchmarks/kernel_variants.py, candidate LoRA-A and conv formulations (VARIANTS_ARGS).
#   "serve" (not in the default STEPS; run it alone: STEPS=serve): benchmarks/serve_load.py, valen-serve under
#   load on the 2b separate export (SERVE_ARGS adds options, e.g. --leak-requests 2000).
#   "tune" (not in the default STEPS): benchmarks/tune_fla.py, FLA's kernel configurations for this GPU
#   (before "ready" in the same call: STEPS="tune ready" measures the cold start with them).
#   "ready" (not in the default STEPS; run it alone: STEPS=ready): valen-serve's ready time with an empty
#   --compile-cache and on a restart with it warm (READY_WARM=0: cold only), with varied-shape load at concurrency 1 and 8 (serve_load.py).
#   "video" (not in the default STEPS; run it alone: STEPS=video): benchmarks/video_latency.py on the 2b preset,
#   H.264 clips against the reference in the same run, and load_video's peak memory at the limits
#   (VIDEO_ARGS adds options, e.g. --skip-reference or --only v3s).
set -uo pipefail
FINAL=${OUT:-/tmp/valen-gpu-out}
OUT=/tmp/valen-gpu-results  # many small files; packed into one archive at the end ($OUT takes 8 files)
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
STEPS=${STEPS:-"tests latency parity"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/transformers-*.whl .whl/tokenizers-*.whl .whl/peft-*.whl \
  .whl/jsonschema-*.whl .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pyspng-*.whl \
  || echo "gpu_run: no pyspng wheel in .whl/ (make gpu-wheels): PNGs decode with Pillow"
# PyAV (FFmpeg inside the wheel; a runtime dependency, the video decoder), which the machine lacks.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/av-*.whl \
  || { echo "gpu_run: no av wheel in .whl/: run make gpu-wheels again (video states need PyAV)"; exit 1; }
# valen-serve's HTTP stack (the serve step and test_serve.py's gpu test) and pytest-xdist (the tests step)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/uvicorn-*.whl .whl/starlette-*.whl .whl/h11-*.whl .whl/anyio-*.whl \
  .whl/pytest_xdist-*.whl .whl/execnet-*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site:/tmp/site-fla"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" >> "$OUT/gpu.txt" 2>&1
WORK=${WORK:-$PWD/build/gpu-bench}  # inside the repo (ignored): kept between calls while the machine stays warm
BUDGET=${BUDGET:-560}
left() { local l=$((BUDGET - SECONDS)); echo $(( l > 5 ? l : 5 )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }

if [[ " $STEPS " == *" profile "* ]]; then
  timeout $(cap ${PROFILE_TIMEOUT:-300}) python3 benchmarks/profile_fast.py --work "$WORK" --out "$OUT/profile.json" --tables "$OUT/profile-tables" \
    ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
  grep -E "total|ready|Error|error" "$OUT/profile.log" | tail -30
fi

if [[ " $STEPS " == *" layers "* ]]; then  # one compiled one-pass layer, random 2B weights (no fixture)
  timeout $(cap ${LAYERS_TIMEOUT:-240}) python3 benchmarks/layer_bench.py --out "$OUT/layer.json" ${LAYERS_ARGS:-} > "$OUT/layer.log" 2>&1
  grep -E "median|us " "$OUT/layer.log" | tail -40
fi

if [[ " $STEPS " == *" variants "* ]]; then  # candidate kernels at 2B shapes, random inputs (no fixture)
  timeout $(cap ${VARIANTS_TIMEOUT:-240}) python3 benchmarks/kernel_variants.py --out "$OUT/variants.json" ${VARIANTS_ARGS:-} > "$OUT/variants.log" 2>&1
  grep -E "M=|conv" "$OUT/variants.log" | tail -20
fi

if [[ " $STEPS " == *" latency "* ]]; then
  timeout $(cap ${LATENCY_TIMEOUT:-330}) python3 benchmarks/latency.py --work "$WORK" --out "$OUT/latency.json" --iters 10 --warmup 3 --ref-iters 3 ${LATENCY_ARGS:-} > "$OUT/latency.log" 2>&1
  grep -E "median|ready|done|ERROR" "$OUT/latency.log" | tail -30
fi

if [[ " $STEPS " == *" video "* ]]; then  # builds fixture-2b and both exports when missing (as the latency step)
  # Each request's host decode runs ~25 times (end to end, host steps, device split): 8 timed runs after 2 keep the
  # step, fixture build included, near 6-7 minutes; it writes its JSON after every request.
  timeout $(cap ${VIDEO_TIMEOUT:-560}) python3 benchmarks/video_latency.py --work "$WORK" --out "$OUT/video-latency.json" \
    --iters 8 --warmup 2 --ref-iters 3 --host-iters 5 ${VIDEO_ARGS:-} > "$OUT/video-latency.log" 2>&1
  echo "video: exit $?"; grep -E "^(v[0-9]|reference|decode peak|clips|engine|fixture|exports)|Error" "$OUT/video-latency.log" | tail -30
fi

if [[ " $STEPS " == *" parity "* ]]; then
  FX="$WORK/fixture-2b"
  # The 2b fixture and the exports the specs name (latency.py builds them too); each only when missing.
  # PARITY_SPECS: LORA:DTYPE:MODE ...; PARITY_CASE: one case group (default all); PARITY_ARGS: more
  # valen-parity options (e.g. --no-cuda-graphs).
  SPECS=${PARITY_SPECS:-"separate:bf16:per-branch separate:bf16:shared-prefix merged:bf16:per-branch separate:fp32:per-branch"}
  python3 - "$WORK" "$(for s in $SPECS; do echo "${s%%:*}"; done | sort -u | tr '\n' ' ')" <<'PY'
import sys
from pathlib import Path
from valen_export.export import export
from valen_export.fixture import build_fixture
work = Path(sys.argv[1]); fx = work / "fixture-2b"
if not (fx / "pins.json").exists():
    build_fixture(fx, preset="2b", seed=0)
for mode in sys.argv[2].split():
    if not (work / f"export-2b-{mode}" / "valen_export.json").exists():
        export(fx / "checkpoint", fx / "base", work / f"export-2b-{mode}", lora_mode=mode, pins_path=fx / "pins.json", progress=False)
PY
  for spec in $SPECS; do
    set -- ${spec//:/ }
    [ "$(left)" -gt 40 ] || { echo "parity $spec: skipped (time)"; continue; }
    # ~70 s of a fresh process go to torch.compile and FLA autotuning before the first case.
    timeout $(cap ${PARITY_TIMEOUT:-300}) python3 -m parity.cli --export "$WORK/export-2b-$1" --checkpoint "$FX/checkpoint" --base "$FX/base" --pins "$FX/pins.json" \
      --case "${PARITY_CASE:-all}" --device cuda --dtype "$2" --mode "$3" ${PARITY_ARGS:-} --report "$OUT/parity-$1-$2-$3.json" > "$OUT/parity-$1-$2-$3.log" 2>&1
    echo "parity $spec: exit $?"; tail -4 "$OUT/parity-$1-$2-$3.log"
  done
fi
if [[ " $STEPS " == *" gate "* ]]; then
  # One gate process per export in GATE_LORA (default both; each compiles its own fast-path
  # variants; they share the GPU and one reference cache): the first starts the reference processes
  # (bf16 and fp32, computed once for the whole set, GATE_SHARDS processes each), the others wait
  # for their results in the cache (kept while the machine stays warm, so a second call reuses
  # it). The fixture and exports are built first, once.
  python3 -c "import sys; from pathlib import Path; from parity.gate import build_inputs; w = Path(sys.argv[1]); build_inputs(w, w, '2b')" "$WORK" \
    > "$OUT/gate-build.log" 2>&1 || { echo "gate: fixture build failed"; tail -5 "$OUT/gate-build.log"; }
  GATE_BUDGET=$(( $(left) - 30 ))
  # A controls process runs them instead; GATE_CONTROLS=0 skips them (a set such as --set video
  # does not exercise every control, and the gate reports an unexercised control as a failure).
  CONTROLS_ARG=--controls; [[ " ${GATE_LORA:-} " == *" controls "* || "${GATE_CONTROLS:-1}" = 0 ]] && CONTROLS_ARG=""
  GATE_ARGS="--device cuda --preset 2b --work $WORK --threads 4 --reference-cache $WORK/reference-cache --reference-shards ${GATE_SHARDS:-2} --budget $GATE_BUDGET ${GATE_ARGS:-}"
  TESTS_PID=""
  if [ "${GATE_TESTS:-1}" = 1 ]; then
    timeout $(cap ${TESTS_TIMEOUT:-420}) python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/valen_runtime/fast/test_model.py -k as_accurate > "$OUT/gate-tests.log" 2>&1 &
    TESTS_PID=$!
  fi
  # GATE_LORA entries: separate, merged, or controls (every negative control of both exports, on
  # the controls' own requests, so it starts its own references and can run beside an export's gate).
  WAIT_ARGS=""; PIDS=""; DIRS=""
  for lora in ${GATE_LORA:-separate merged}; do
    if [ "$lora" = controls ]; then
      timeout $(( GATE_BUDGET + 20 )) python3 -m parity.gate "$OUT/gate-controls" --only-controls $GATE_ARGS > "$OUT/gate-controls.log" 2>&1 &
    else
      timeout $(( GATE_BUDGET + 20 )) python3 -m parity.gate "$OUT/gate-$lora" --lora $lora $CONTROLS_ARG $WAIT_ARGS $GATE_ARGS > "$OUT/gate-$lora.log" 2>&1 &
      WAIT_ARGS="--wait-for-references $GATE_BUDGET"
    fi
    PIDS="$PIDS $lora:$!"; DIRS="$DIRS $OUT/gate-$lora"
  done
  RCS=""
  for entry in $PIDS; do wait "${entry#*:}"; RCS="$RCS ${entry%%:*} exit $?;"; done
  TESTS_RC=skipped; [ -n "$TESTS_PID" ] && { wait $TESTS_PID; TESTS_RC=$?; }
  python3 -m parity.summary $DIRS --markdown > "$OUT/gate-summary.txt" 2>&1
  cat "$OUT/gate-summary.txt"
  grep -E "truth-relative:|passed|failed|error" "$OUT/gate-tests.log" 2>/dev/null | tail -8
  echo "gate:$RCS (0 = every configuration passed and every control failed); truth-relative GPU tests exit $TESTS_RC"
fi

if [[ " $STEPS " == *" serve "* ]]; then  # builds fixture-2b and export-2b-separate when missing (as the parity step)
  timeout $(cap ${SERVE_TIMEOUT:-540}) python3 benchmarks/serve_load.py --export "$WORK/export-2b-separate" --build 2b --device cuda \
    --out "$OUT/serve-load.json" --requests 1000 --duration 30 --leak-duration 150 --startup-timeout 360 ${SERVE_ARGS:-} > "$OUT/serve-load.log" 2>&1
  echo "serve: exit $?"; tail -8 "$OUT/serve-load.log"
fi
if [[ " $STEPS " == *" tune "* ]]; then
  # FLA's kernels autotuned from scratch over valen-serve's warmup, the choices written in FLA's
  # config format (benchmarks/tune_fla.py) to $OUT/fla_configs/<GPU>/ (commit it under
  # valen_runtime/fast/fla_configs/ to ship it) and into this tree, so a later step of the same call uses them.
  timeout $(cap ${TUNE_TIMEOUT:-300}) python3 benchmarks/tune_fla.py --export "$WORK/export-2b-separate" --build 2b \
    --out "$OUT/fla_configs" > "$OUT/tune-fla.log" 2>&1
  tuned=$?; echo "tune: exit $tuned"; grep -c "Triton autotuning" "$OUT/tune-fla.log"; tail -2 "$OUT/tune-fla.log"
  [ $tuned = 0 ] && cp -r "$OUT"/fla_configs/. valen_runtime/fast/fla_configs/
fi
if [[ " $STEPS " == *" ready "* ]]; then
  # valen-serve's ready time with an empty compile cache (then varied-shape load at concurrency 1
  # and 8 and a short memory phase), and again on a restart with that cache warm.
  CACHE="$WORK/compile-cache"; rm -rf "$CACHE"
  # TORCH_LOGS: each compile's start and end (dynamo, timestamped) and the guard behind each
  # recompile, in the JSON's server_other_lines (READY_TORCH_LOGS= turns it off), with a line for
  # each kernel FLA autotunes (TRITON_PRINT_AUTOTUNING).
  TRITON_PRINT_AUTOTUNING=1 TORCH_LOGS="${READY_TORCH_LOGS-dynamo,recompiles}" timeout $(cap ${READY_COLD_TIMEOUT:-420}) python3 benchmarks/serve_load.py --export "$WORK/export-2b-separate" --build 2b --device cuda \
    --out "$OUT/serve-cold.json" --new-shapes --concurrency 1,8 --requests 1000 --duration 20 --leak-requests 1500 --leak-duration 40 \
    --startup-timeout 330 --serve-args "--compile-cache $CACHE ${SERVE_ARGS:-}" > "$OUT/serve-cold.log" 2>&1
  echo "ready (cold cache): exit $?"; tail -7 "$OUT/serve-cold.log"
  if [ "${READY_WARM:-1}" = 1 ]; then
    timeout $(cap 200) python3 benchmarks/serve_load.py --export "$WORK/export-2b-separate" --device cuda \
      --out "$OUT/serve-warm.json" --new-shapes --concurrency 1 --requests 300 --duration 10 --leak-requests 100 --leak-duration 10 \
      --startup-timeout 180 --serve-args "--compile-cache $CACHE ${SERVE_ARGS:-}" > "$OUT/serve-warm.log" 2>&1
    echo "ready (warm cache): exit $?"; tail -5 "$OUT/serve-warm.log"
  fi
fi
if [[ " $STEPS " == *" tests "* ]]; then
  # Every gpu-marked test, in TEST_WORKERS processes sharing the GPU (xdist; each test compiles on the
  # host's cores, and inductor's on-disk cache is shared between the processes). test_serve.py comes
  # first so its longest test (a worker's whole CUDA warmup) starts at once and the rest fill around it.
  timeout $(cap ${TESTS_TIMEOUT:-480}) python3 -m pytest -q -p no:cacheprovider -m gpu -n ${TEST_WORKERS:-4} --durations=30 \
    tests/valen_runtime/test_serve.py tests/valen_runtime/fast tests/valen_runtime/test_engine.py tests/valen_runtime/test_image.py \
    tests/valen_runtime/test_cancel.py \
    ${TESTS_ARGS:-} > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests: exit $? in $SECONDS s"; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
fi

ls -la "$OUT"
tar -czf "$FINAL/gpu-results.tar.gz" -C "$OUT" .
cp "$OUT/latency.json" "$FINAL/" 2>/dev/null || true
cp "$OUT/video-latency.json" "$FINAL/" 2>/dev/null || true
cp "$OUT/layer.json" "$FINAL/" 2>/dev/null || true
cp "$OUT/variants.json" "$FINAL/" 2>/dev/null || true
cp "$OUT/gate-summary.txt" "$FINAL/" 2>/dev/null || true
cp "$OUT/serve-load.json" "$FINAL/" 2>/dev/null || true
