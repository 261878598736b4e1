"""The service entry point: `python -m trainer_svc` and `torchrun ... -m trainer_svc`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer_svc.config import ModelArgs
from trainer_svc.tiny import TINY_ARGS

BATCH = [
    "--steps",
    "3",
    "--seed",
    "7",
    "--lr",
    "1e-4",
    "--weight-decay",
    "0.01",
    "--global-batch-size",
    "8",
    "--seq-len",
    "16",
    "--microbatches",
    "2",
    "--device",
    "cpu",
]
STEP_LINE = re.compile(r"rank=0 .*step (\d) loss ([\d.]+) grad_norm ([\d.]+) tokens/s ([\d.]+)")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run in a session of its own so a hang cannot leave ranks behind: on timeout the whole
    process group is killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_random_init_from_config_trains_and_exports(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_ARGS.to_hf()))
    out = _run(
        [
            sys.executable,
            "-m",
            "trainer_svc",
            "--init-config",
            str(cfg),
            "--export-dir",
            str(tmp_path / "x"),
            *BATCH,
        ],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    steps = STEP_LINE.findall(out.stderr)
    assert [s[0] for s in steps] == ["1", "2", "3"], out.stderr
    assert ModelArgs.from_file(tmp_path / "x" / "config.json") == TINY_ARGS
    assert len(load_file(str(tmp_path / "x" / "model.safetensors"))) == 1 + 4 * (9 + 3 * 8) + 2


def test_bad_flags_exit_with_a_clear_message(tmp_path):
    out = _run(
        [
            sys.executable,
            "-m",
            "trainer_svc",
            "--model-dir",
            str(tmp_path),
            "--ep",
            "2",
            "--global-batch-size",
            "6",
        ],
        timeout=60,
    )
    assert out.returncode == 2
    assert "global-batch-size 6 must be divisible by dp 1 x ep 2 x microbatches 2" in out.stderr


def test_torchrun_layout_exports_the_same_model(run_layout, tiny_dir, tmp_path):
    """torchrun (env:// rendezvous) on 2 ranks gives the export of the spawned ep=2 run, bit for bit."""
    torchrun = Path(sys.executable).parent / "torchrun"
    out = _run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "trainer_svc",
            "--ep",
            "2",
            "--model-dir",
            tiny_dir,
            "--export-dir",
            str(tmp_path / "x"),
            *BATCH,
        ],
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(STEP_LINE.findall(out.stderr)) == 3  # rank 0 only logs steps
    assert "rank=1 INFO trainer_svc: step" not in out.stderr
    _, spawned = run_layout(1, 1, 2, 1)
    got, want = (
        load_file(str(tmp_path / "x" / "model.safetensors")),
        load_file(str(spawned / "model.safetensors")),
    )
    assert all(torch.equal(got[k], want[k]) for k in want)
