"""Helpers for the DTensor attach tests: run a script under torchrun on 4 gloo ranks."""

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


@pytest.fixture(scope="session")
def kv4_model(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with 4 kv heads, so attention splits over tp 4 in whole heads."""
    from trainer_svc.config import ModelArgs
    from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

    args = ModelArgs(**{**TINY_ARGS.__dict__, "num_key_value_heads": 4})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv4"), seed=0, args=args)
