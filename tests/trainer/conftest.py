"""Shared fixtures for trainer_svc tests: one tiny checkpoint per session, few threads, and a
session cache of multi-process training runs (the layout and catalog tests share them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trainer_svc.settings import TrainSettings
from trainer_svc.tiny import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parent))  # _launch must be importable in forkserver workers

import _launch
from _launch import TRAIN

torch.set_num_threads(1)

# lr 1e-4: AdamW normalises each gradient element, so elements whose gradient is near its eps
# (1e-8) turn float32 summation-order noise into update noise of order lr; a realistic
# fine-tuning lr keeps that noise below the 1e-5 tolerance while updates stay far above it.


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def run_layout(tiny_dir, tmp_path_factory):
    """run_layout(pp, dp, ep, tp, **overrides of TRAIN or model_dir) -> (rank outputs, export dir);
    each distinct run trains once per session."""
    cache: dict[tuple, tuple[list[_launch.RankOutput], Path]] = {}

    def run(pp: int, dp: int, ep: int, tp: int, **overrides):
        key = (pp, dp, ep, tp, *sorted(overrides.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"pp{pp}dp{dp}ep{ep}tp{tp}")
            settings = TrainSettings(
                **{
                    "model_dir": tiny_dir,
                    "pp": pp,
                    "dp": dp,
                    "ep": ep,
                    "tp": tp,
                    "device": "cpu",
                    "export_dir": str(out / "export"),
                    **TRAIN,
                    **overrides,
                }
            )
            cache[key] = (_launch.run_job(settings, out), out / "export")
        return cache[key]

    return run
