#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: install the carried nccl4py wheel, run the GPU
# tests, then the 2-GPU refit benchmark (and, with PROFILE=1, profiler traces and their summary).
# Usage: bash bench/gpu_run.sh [GIB]; results in $OUT.
# Environment: BUCKET_MIBS (comma-separated, first is the headline; default 512,256,1024),
# IN_FLIGHTS (space-separated staging depths, default 2), REPS (default 7), GRAPHS=1 (also the refit
# with CUDA graphs, syncd/member/dataplane/graphs.py), GPU_TESTS (more
# tests to run). With 4 GPUs it also runs bench/stage_bench.py (results in gpu-4x.json).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gib=${1:-8}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu ${GPU_TESTS:-} 2>&1 | tee "$out/gpu-tests.log"
for depth in ${IN_FLIGHTS:-2}; do
  name="depth$depth"
  profile=()
  [[ -n "${PROFILE:-}" ]] && profile=(--profile "$out/prof-$name")
  python3 bench/refit_bench.py --backend nccl --gib "$gib" --bucket-mib "${BUCKET_MIBS:-512,256,1024}" \
    --in-flight "$depth" --reps "${REPS:-7}" --json "$out/gpu-2x-$name.json" "${profile[@]}" ${GRAPHS:+--graphs} 2>&1 \
    | grep -v "USDT\|UserWarning\|return func\|_warn_once" | tee -a "$out/bench.log"
  if [[ -n "${PROFILE:-}" ]]; then  # one file to fetch: the device tool returns a handful of files
    python3 bench/trace_summary.py "$out/prof-$name"/refit-*.json.gz | tee -a "$out/bench.log"
    tar -cf "$out/prof-$name.tar" -C "$out" "prof-$name" && rm -r "${out:?}/prof-$name"
  fi
done
# On a machine with 4 GPUs or more: the per-PP-stage run (trainer pp=2 on GPUs 0-1, a TP=2 receiver
# on GPUs 2-3, one communicator per stage, stages concurrent vs serialized).
if (( $(nvidia-smi -L | wc -l) >= 4 )); then
  python3 bench/stage_bench.py --backend nccl --gib "$gib" --pp 2 --tp 2 --bucket-mib "${BUCKET_MIBS%%,*}" \
    --reps "${REPS:-7}" --json "$out/gpu-4x.json" 2>&1 | grep -v "USDT\|UserWarning\|return func\|_warn_once" \
    | tee -a "$out/bench.log"
fi
