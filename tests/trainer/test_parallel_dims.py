"""The mesh is built and validated in one place, with errors that name the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.settings import TrainSettings
from trainer_svc.tiny import TINY_ARGS


@pytest.mark.parametrize(
    "dims,world,match",
    [
        (ParallelDims(pp=2, ep=2, tp=2), 4, r"world size 4 != pp 2 x dp 1 x ep 2 x tp 2 = 8"),
        (ParallelDims(ep=3), 3, r"ep 3 must divide num_experts 8"),
        (ParallelDims(tp=4), 4, r"tp 4 must divide num_key_value_heads 2"),
        (ParallelDims(pp=5), 5, r"pp 5 exceeds num_hidden_layers 4"),
    ],
)
def test_invalid_layouts_are_refused(dims, world, match):
    with pytest.raises(ValueError, match=match):
        dims.validate(TINY_ARGS, world)


def test_tp_must_divide_heads_and_expert_intermediate():
    with pytest.raises(ValueError, match="tp 3 must divide num_attention_heads 4"):
        ParallelDims(tp=3).validate(TINY_ARGS)
    args = dataclasses.replace(TINY_ARGS, moe_intermediate_size=66)
    with pytest.raises(ValueError, match="tp 4 must divide moe_intermediate_size 66"):
        ParallelDims(tp=4).validate(dataclasses.replace(args, num_key_value_heads=4))


def test_mesh_sizes_must_be_positive():
    with pytest.raises(ValueError, match="mesh dim ep must be a positive integer, got 0"):
        ParallelDims(ep=0)


def test_rank_order_is_pp_major_tp_minor():
    dims = ParallelDims(pp=2, dp=1, ep=2, tp=2)
    assert dims.coords(0) == Coords(0, 0, 0, 0)
    assert dims.coords(1) == Coords(0, 0, 0, 1)
    assert dims.coords(2) == Coords(0, 0, 1, 0)
    assert dims.coords(7) == Coords(1, 0, 1, 1)
    assert [dims.rank_of(c) for c in dims.all_coords()] == list(range(8))


def test_settings_parse_the_documented_flags(tmp_path):
    s = TrainSettings.from_argv(
        [
            "--model-dir",
            str(tmp_path),
            "--pp",
            "2",
            "--ep",
            "2",
            "--tp",
            "2",
            "--dp",
            "1",
            "--steps",
            "5",
            "--seed",
            "3",
            "--lr",
            "0.01",
            "--global-batch-size",
            "16",
            "--seq-len",
            "64",
            "--microbatches",
            "4",
            "--export-dir",
            "out",
            "--syncd",
            "localhost:50051",
        ]
    )
    assert (s.pp, s.dp, s.ep, s.tp, s.steps, s.seed, s.lr) == (2, 1, 2, 2, 5, 3, 0.01)
    assert (s.global_batch_size, s.seq_len, s.microbatches) == (16, 64, 4)
    assert s.export_dir == "out" and s.syncd == "localhost:50051" and s.dims.world_size == 8


def test_settings_refuse_a_batch_that_does_not_split():
    with pytest.raises(
        ValueError, match="global-batch-size 6 must be divisible by dp 1 x ep 2 x microbatches 2"
    ):
        TrainSettings(init_config="c.json", ep=2, global_batch_size=6, microbatches=2)
    with pytest.raises(ValueError, match="exactly one of --model-dir"):
        TrainSettings()
