"""NCCL variant of the layout test: ep=2 and tp=2 (and pp=2) on 2 GPUs match one GPU.

Run on a GPU machine with `pytest tests/trainer -m gpu`; skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import _launch
import pytest
import torch
from _launch import TRAIN
from safetensors.torch import load_file

from trainer_svc.settings import TrainSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
RTOL = 1e-5


def _run(tiny_dir: str, out, **dims) -> tuple[list[_launch.RankOutput], dict]:
    settings = TrainSettings(
        model_dir=tiny_dir, device="cuda", export_dir=str(out / "export"), **dims, **TRAIN
    )
    ranks = _launch.run_job(settings, out)
    return ranks, load_file(str(out / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def gpu_reference(tiny_dir, tmp_path_factory):
    return _run(tiny_dir, tmp_path_factory.mktemp("gpu_ref"))


@pytest.mark.parametrize("dims", [{"ep": 2}, {"tp": 2}, {"pp": 2}], ids=["ep2", "tp2", "pp2"])
def test_nccl_layout_matches_single_gpu(tiny_dir, tmp_path_factory, gpu_reference, dims):
    ref_ranks, want = gpu_reference
    ranks, got = _run(tiny_dir, tmp_path_factory.mktemp("gpu_layout"), **dims)
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r.losses), torch.tensor(ref_ranks[0].losses), rtol=RTOL, atol=0
        )
    assert sorted(got) == sorted(want)
    for name in want:
        rel = float((got[name] - want[name]).norm() / want[name].norm())
        assert rel <= RTOL, f"{name}: relative error {rel:.2e}"
