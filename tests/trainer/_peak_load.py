"""Run as a script: load ranks' parameters from a checkpoint, print peak host memory as JSON.

    python _peak_load.py MODEL_DIR EP:EP_RANK:{shards|whole} ...

One JSON line per measurement, run one after another (each frees what it loaded; run this with
MALLOC_MMAP_THRESHOLD_ low, so that freed memory leaves the process and the next peak starts clean).

`shards` reads the rank's boxes (`sharded_io.read_shards`) into tensors of its catalog's shapes;
`whole` is the old way, every rank reading the full model (`load_hf`). Peak = the highest resident
memory (VmHWM, reset after imports) above the resident memory before loading started.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer_svc.catalog import build_catalog
from trainer_svc.config import ModelArgs
from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.sharded_io import read_shards

MIB = 2**20


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(field)


def measure(model_dir: str, ep: int, ep_rank: int, mode: str) -> dict:
    args = ModelArgs.from_file(Path(model_dir) / "config.json")
    catalog = build_catalog(args, ParallelDims(ep=ep), Coords(pp=0, dp=0, ep=ep_rank, tp=0))
    shard_mib = sum(torch.Size(t.shape).numel() * 4 for t in catalog.tensors) / MIB
    model_mib = sum(torch.Size(c.shape).numel() * 4 for c in catalog.canonical) / MIB
    Path("/proc/self/clear_refs").write_text("5")  # forget earlier peaks (imports, measurements)
    base = _status_mib("VmRSS")
    if mode == "shards":
        views = {t.name: torch.zeros(t.shape) for t in catalog.tensors}
        read_shards(model_dir, catalog, views)
    else:
        load_hf(model_dir)
    return {"peak_mib": _status_mib("VmHWM") - base, "shard_mib": shard_mib, "model_mib": model_mib}


if __name__ == "__main__":
    for spec in sys.argv[2:]:
        ep, ep_rank, mode = spec.split(":")
        print(json.dumps(measure(sys.argv[1], int(ep), int(ep_rank), mode)), flush=True)
