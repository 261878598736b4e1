#!/usr/bin/env bash
# Everything a GPU machine runs, in one call: install the carried wheels (.whl/, when there), run
# the GPU tests, then every GPU benchmark its GPUs allow. Each benchmark writes one JSON file,
# $OUT/gpu/CARD-NGPU-BENCH-DATE.json (e.g. h200-2gpu-refit-2026-11-28.json), each with `device`,
# `date` and its ratios; copy them into bench/results/gpu/ and run `python -m bench.gpu_table
# --write` to regenerate the README's GPU table from them.
# Usage: bash bench/gpu_run.sh [GIB]   (model size of the refit benchmarks, default 8)
#   - every GPU count: the landed check alone against a device copy (landed), CUDA IPC refits
#     at 4 and 9 GiB (colocated-4gib, colocated-9gib), FP8 quantize-and-pack (fp8);
#   - two GPUs or more: the refit against raw NCCL at 512, 256 and 64 MiB buckets (refit);
#   - four GPUs or more: trainer pp=2 on GPUs 0-1 into a TP=2 receiver on GPUs 2-3, one
#     communicator per stage, stages concurrent and serialized (stages).
# Environment: BUCKET_MIBS (the refit's bucket sizes, first is the headline; default 512,256,64),
# REPS (default 7), PROFILE=1 (profiler traces of the refit and of the stages, and their summary),
# LOOPBACK=1 (also the one-GPU loop-back pipeline, bench/loopback_bench.py, with BEFORE_TREE=DIR an
# earlier tree in the same call), GPU_TESTS (more tests to run), SKIP_TESTS=1.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gib=${1:-8}
out=${OUT:-/tmp/out}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 1
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$here
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
nvidia-smi topo -m | head -5
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
if [[ -z "${SKIP_TESTS:-}" ]]; then
  # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
  python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu ${GPU_TESTS:-} 2>&1 | tee "$out/gpu-tests.log"
fi
quiet() { grep -v "USDT\|UserWarning\|return func\|_warn_once\|warn(" | tee -a "$out/bench.log"; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE "[a-z][0-9]{2,3}[a-z]*" | head -1 | tr "[:upper:]" "[:lower:]")
mkdir -p "$out/gpu"
result() { echo "$out/gpu/${card:-gpu}-${gpus}gpu-$1-$(date -u +%F).json"; }
reps=${REPS:-7}

python3 -m bench.landed_bench --device cuda --rounds "$reps" --json "$(result landed)" 2>&1 | quiet
for size in 4 9; do
  python3 bench/colocated_bench.py --device cuda --gib "$size" --reps "$reps" --json "$(result "colocated-${size}gib")" 2>&1 | quiet
done
python3 bench/fp8_quantize_bench.py --gib 4 --reps "$reps" --json "$(result fp8)" 2>&1 | quiet
loopback() {  # label, tree whose syncd is measured (loopback_bench.py puts this tree after it)
  local label=$1 tree=$2
  PYTHONPATH=/tmp/site:$tree python3 "$here/bench/loopback_bench.py" --gib "$gib" \
    --bucket-mib "${BUCKET_MIBS:-512,256,64}" --reps "${REPS:-7}" --label "$label" \
    --json "$out/loopback-$label.json" --profile "$out/prof-$label" "${@:3}" 2>&1 | quiet
}
if [[ -n "${LOOPBACK:-}" ]]; then
  [[ -n "${BEFORE_TREE:-}" ]] && loopback before "$BEFORE_TREE"
  loopback "${LABEL:-after}" "$here" --graphs-too
  for prof in "$out"/prof-*; do  # one file per trace directory: the device tool returns a handful
    [[ -d "$prof" ]] || continue
    python3 bench/trace_summary.py "$prof"/*.json 2>&1 | tee -a "$out/bench.log"
    gzip "$prof"/*.json
    tar -cf "$prof.tar" -C "$out" "$(basename "$prof")" && rm -r "$prof"
  done
fi

if (( gpus >= 2 )); then
  profile=()
  [[ -n "${PROFILE:-}" ]] && profile=(--profile "$out/prof-refit")
  python3 bench/refit_bench.py --backend nccl --gib "$gib" --bucket-mib "${BUCKET_MIBS:-512,256,64}" \
    --reps "$reps" --json "$(result refit)" "${profile[@]}" 2>&1 | quiet
  if [[ -n "${PROFILE:-}" ]]; then
    python3 bench/trace_summary.py "$out/prof-refit"/refit-*.json.gz | tee -a "$out/bench.log"
    tar -cf "$out/prof-refit.tar" -C "$out" "prof-refit" && rm -r "${out:?}/prof-refit"
  fi
fi
# Trainer pp=2 on GPUs 0-1, a TP=2 receiver on GPUs 2-3, one communicator per stage, stages
# concurrent vs serialized.
if (( gpus >= 4 )); then
  profile=()
  [[ -n "${PROFILE:-}" ]] && profile=(--profile "$out/prof-stages")
  python3 bench/stage_bench.py --backend nccl --gib "$gib" --pp 2 --tp 2 \
    --bucket-mib "$(echo "${BUCKET_MIBS:-512}" | cut -d, -f1)" --reps "$reps" --json "$(result stages)" \
    "${profile[@]}" 2>&1 | quiet
  if [[ -n "${PROFILE:-}" ]]; then
    python3 bench/trace_summary.py "$out/prof-stages"/stages-*.json.gz | tee -a "$out/bench.log"
    tar -cf "$out/prof-stages.tar" -C "$out" "prof-stages" && rm -r "${out:?}/prof-stages"
  fi
fi
