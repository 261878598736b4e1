"""The sharding table's name mapping and shapes, which the gathering code relies on to view a
parameter before it cuts or concatenates it."""

from __future__ import annotations

import pytest

from trainer_svc.canonical import canonical_shapes
from trainer_svc.catalog import build_catalog
from trainer_svc.parallel_dims import ParallelDims
from trainer_svc.sharding import local_shape, param_names, sources
from trainer_svc.tiny import TINY_ARGS


def test_every_canonical_tensor_is_held_by_exactly_one_parameter():
    canonical = list(canonical_shapes(TINY_ARGS))
    params = param_names(canonical)
    held = [name for p in params for name in sources(p)]
    assert sorted(held) == sorted(canonical)
    assert "model.layers.0.mlp.experts.gate_up_proj" in params
    assert sources("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts.gate_proj.weight",
        "model.layers.0.mlp.experts.up_proj.weight",
    )


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_local_shape_is_the_catalog_shape(ep, tp):
    dims = ParallelDims(ep=ep, tp=tp)
    shapes = canonical_shapes(TINY_ARGS)
    for c in dims.all_coords():
        for t in build_catalog(TINY_ARGS, dims, c).tensors:
            assert local_shape(t.name, shapes, dims) == t.shape, (c, t.name)
