#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: install the carried nccl4py wheel, run the GPU
# tests, then the 2-GPU refit benchmark. Usage: bash bench/gpu_run.sh [GIB] (results in $OUT).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gib=${1:-8}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu ${GPU_TESTS:-} 2>&1 | tee "$out/gpu-tests.log"
for mib in ${BUCKET_MIBS:-256}; do
  python3 bench/refit_bench.py --backend nccl --gib "$gib" --bucket-mib "$mib" --in-flight "${IN_FLIGHT:-2}" --json "$out/gpu-2x-$mib.json" 2>&1 | tee -a "$out/bench.log"
done
