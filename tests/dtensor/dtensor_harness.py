"""Helpers for the DTensor attach tests: torchrun on 4 gloo ranks, the 4-kv-head tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def torchrun(script: str, *args: str, timeout_s: float = 600, env: dict[str, str] | None = None) -> str:
    """Run tests/dtensor/`script` on 4 CPU ranks; fail with its output tail if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run(
        [*cmd, str(REPO / "tests" / "dtensor" / script), *args],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    text = out.stdout + out.stderr
    if out.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed ({out.returncode}):\n{text[-6000:]}")
    return text
