#!/usr/bin/env bash
# What one GPU runs in one call: the GPU tests, then the loop-back benchmark of this tree and, when
# given, of an earlier tree (its `syncd/` only) in the same call, so before/after share a machine.
# Usage: bash bench/loopback_run.sh [EARLIER_TREE]; results in $OUT (at most 8 files come back).
# Environment: GIB (default 8), BUCKET_MIBS (default 512,256,64), REPS (default 7).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
(cd "$here" && PYTHONPATH="${PYTHONPATH:-}:$here" python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu 2>&1 \
  | tail -15 | tee "$out/gpu-tests.log")
bench() {  # label, tree whose syncd is measured, extra arguments
  local label=$1 tree=$2
  shift 2
  PYTHONPATH="${PYTHONPATH:-}:$tree" python3 "$here/bench/loopback_bench.py" --gib "${GIB:-8}" \
    --bucket-mib "${BUCKET_MIBS:-512,256,64}" --reps "${REPS:-7}" --label "$label" \
    --json "$out/loopback-$label.json" "$@" 2>&1 | grep -v "USDT\|UserWarning\|warn(" | tee -a "$out/loopback.log"
}
if [[ -n "${1:-}" ]]; then
  bench before "$1" --profile "$out/prof-before"
fi
bench "${LABEL:-after}" "$here" --profile "$out/prof-${LABEL:-after}" --graphs-too
for prof in "$out"/prof-*; do
  [[ -d "$prof" ]] || continue
  python3 "$here/bench/trace_summary.py" "$prof"/*.json >>"$out/loopback.log" 2>&1
  gzip "$prof"/*.json
  tar -cf "$prof.tar" -C "$out" "$(basename "$prof")" && rm -r "$prof"
done
