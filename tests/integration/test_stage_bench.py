"""The per-PP-stage benchmark (bench/stage_bench.py) runs its real topology: two trainer stages
into a TP=2 receiver, one group per stage, stages concurrent and serialized; every receiver tensor
bit-exact and the checksums accepted by syncd's own comparison. On CPU with gloo here; the same
script with --backend nccl is the 4-GPU run (tests/gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stage_bench_moves_both_stages_bit_exactly_on_cpu(tmp_path):
    out = tmp_path / "stage.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/stage_bench.py",
            "--backend",
            "gloo",
            "--gib",
            "0.01",
            "--bucket-mib",
            "4",
            "--reps",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bit_exact"] and result["checksums_ok"]
    assert set(result["bytes_per_stage"]) == {"0", "1"} and all(
        v > 0 for v in result["bytes_per_stage"].values()
    )
    assert sum(result["bytes_per_stage"].values()) == result["bytes"]
    for key in ("concurrent_seconds", "serialized_seconds", "raw_gbps", "bytes", "date", "device"):
        assert result[key], key
