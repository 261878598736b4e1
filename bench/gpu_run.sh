#!/usr/bin/env bash
# Everything a GPU machine runs, in one call: install the carried nccl4py wheel (.whl/, when
# there), run the GPU tests, then the benchmarks its GPUs allow; results in $OUT.
# Usage: bash bench/gpu_run.sh [GIB]   (model size, default 8)
#   - one GPU (or LOOPBACK=1): the loop-back pipeline (bench/loopback_bench.py, loopback-LABEL.json)
#     of this tree and, with BEFORE_TREE=DIR, of an earlier tree's `syncd/` in the same call, so
#     before and after share a machine; with profiler traces of both and their summary;
#   - two GPUs or more: the refit benchmark (bench/refit_bench.py, gpu-2x-depthN.json; with
#     PROFILE=1 also profiler traces and their summary);
#   - four GPUs or more: the per-PP-stage run (bench/stage_bench.py, gpu-4x.json).
# Environment: BUCKET_MIBS (comma-separated, first is the headline; default 512,256,1024 for the
# refit, 512,256,64 for the loop-back), IN_FLIGHTS (space-separated staging depths, default 2),
# REPS (default 7), GRAPHS=1 (also the refit with CUDA graphs, syncd/member/dataplane/graphs.py),
# LABEL (the loop-back's name for this tree, default after), GPU_TESTS (more tests to run).
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
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu ${GPU_TESTS:-} 2>&1 | tee "$out/gpu-tests.log"
quiet() { grep -v "USDT\|UserWarning\|return func\|_warn_once\|warn(" | tee -a "$out/bench.log"; }

loopback() {  # label, tree whose syncd is measured (loopback_bench.py puts this tree after it)
  local label=$1 tree=$2
  PYTHONPATH=/tmp/site:$tree python3 "$here/bench/loopback_bench.py" --gib "$gib" \
    --bucket-mib "${BUCKET_MIBS:-512,256,64}" --reps "${REPS:-7}" --label "$label" \
    --json "$out/loopback-$label.json" --profile "$out/prof-$label" "${@:3}" 2>&1 | quiet
}
if (( gpus == 1 )) || [[ -n "${LOOPBACK:-}" ]]; then
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
  for depth in ${IN_FLIGHTS:-2}; do
    name="depth$depth"
    profile=()
    [[ -n "${PROFILE:-}" ]] && profile=(--profile "$out/prof-$name")
    python3 bench/refit_bench.py --backend nccl --gib "$gib" --bucket-mib "${BUCKET_MIBS:-512,256,1024}" \
      --in-flight "$depth" --reps "${REPS:-7}" --json "$out/gpu-2x-$name.json" "${profile[@]}" ${GRAPHS:+--graphs} \
      2>&1 | quiet
    if [[ -n "${PROFILE:-}" ]]; then
      python3 bench/trace_summary.py "$out/prof-$name"/refit-*.json.gz | tee -a "$out/bench.log"
      tar -cf "$out/prof-$name.tar" -C "$out" "prof-$name" && rm -r "${out:?}/prof-$name"
    fi
  done
fi
# Trainer pp=2 on GPUs 0-1, a TP=2 receiver on GPUs 2-3, one communicator per stage, stages
# concurrent vs serialized.
if (( gpus >= 4 )); then
  python3 bench/stage_bench.py --backend nccl --gib "$gib" --pp 2 --tp 2 \
    --bucket-mib "$(echo "${BUCKET_MIBS:-512}" | cut -d, -f1)" --reps "${REPS:-7}" --json "$out/gpu-4x.json" 2>&1 \
    | quiet
fi
