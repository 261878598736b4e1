"""`make demo`, the main job, as a user runs it: every refit commits, every byte checks, the
generator's policy matches the trainer's after each refit, and bfloat16 moves 2 bytes per weight."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from safetensors import safe_open

from deploy.local.processes import PYTHON, REPO

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_the_demo_refits_a_bfloat16_generator_after_every_step(tmp_path):
    summary_path, work = tmp_path / "summary.json", tmp_path / "demo"
    run = subprocess.run(
        [
            PYTHON,
            "-m",
            "deploy.local.demo",
            "--steps",
            "2",
            "--workdir",
            str(work),
            "--summary-json",
            str(summary_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["refits"] == summary["refits_committed"] == 2 and summary["checksums_ok"], summary
    # After a refit the generator (bfloat16 arithmetic) samples as the trainer scores its bfloat16
    # export (float32 arithmetic): equal weights, so only the arithmetic differs; before, the
    # policies are a training step apart.
    assert summary["kl_after_max"] < 1e-4 < summary["kl_before_first"], summary
    with safe_open(str(work / "export" / "step-1" / "model.safetensors"), framework="pt") as f:
        elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    assert [p["bytes"] for p in summary["refit_phases"]] == [2 * elements] * 2, summary["refit_phases"]
