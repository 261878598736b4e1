"""The DTensor internals `syncd.member.torch_dtensor` relies on, one test per symbol: an upgrade
of torch that moves or changes one fails here, by name, not deep inside a refit."""

from __future__ import annotations

import torch

from syncd.member import torch_dtensor as tdt


def test_torch_version_is_a_tested_one():
    assert tdt.torch_version_tested(), f"torch {torch.__version__}; tested: {tdt.TESTED_TORCH}"


def test_shard_split_is_torch_chunk_with_empty_tail():
    # torch.chunk(arange(5), 4) gives only 3 chunks; DTensor's Shard gives the 4th rank nothing
    got = [tdt.held_indices(tdt.Shard(0), torch.arange(5), 4, c).tolist() for c in range(4)]
    assert got == [[0, 1], [2, 3], [4], []]


def test_strided_shard_split_interleaves_as_fsdp2_on_tp():
    # The docstring example of _StridedShard: 9 elements, split factor 2, 4 chunks.
    got = [
        tdt.held_indices(tdt.StridedShard(0, split_factor=2), torch.arange(9), 4, c).tolist()
        for c in range(4)
    ]
    assert got == [[0, 1, 5], [2, 3, 6], [4, 7], [8]]
    assert tdt.split_factor(tdt.StridedShard(0, split_factor=3)) == 3


def test_local_shape_helper_is_importable_and_callable():
    # compute_local_shape_and_global_offset needs a mesh; its import and signature are checked here,
    # its values on real meshes by test_placement_boxes.py (every held_runs call cross-checks it).
    import inspect

    params = list(inspect.signature(tdt.compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"]


def test_shard_dim_reads_both_placement_kinds():
    assert tdt.shard_dim(tdt.Shard(2)) == 2
    assert tdt.shard_dim(tdt.StridedShard(1, split_factor=2)) == 1
