"""Blockwise FP8: the reference quantizer (edge blocks included), the refusal of shards that cut a
block, and bfloat16 trainer ranks planned and packed into FP8 destinations (values and scales equal
the block-by-block definition, at any bucket size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.layout import Box, Canon, CanonicalTensor, Catalog, Concat, Shard, Sharded, local_tensor
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views, pack_into, unpack_from
from syncd.member.dataplane.fp8 import E4M3_MAX, dequantize_blockwise, quantize_blockwise
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.fp8_blocks import blockwise_fp8_catalog, require_whole_blocks, scale_name, scale_shape
from syncd.plan.simulate import materialize
from tests.fp8_reference import block_by_block, checkpoint_arrays


def _weights(*shape: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose spread differs by row, so blocks get different scales."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, shape[-2]).view(-1, 1)
    return torch.randn(shape, generator=gen) * rows


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 129), (77, 5)])
def test_quantizer_equals_the_block_by_block_definition_including_edge_blocks(shape):
    x = _weights(*shape)
    q, s = quantize_blockwise(x)
    ref_q, ref_s = block_by_block(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_grouped_experts_get_one_grid_per_expert():
    x = _weights(3, 200, 130)
    q, s = quantize_blockwise(x)
    assert tuple(s.shape) == (3, 2, 2)
    for e in range(3):
        q_e, s_e = quantize_blockwise(x[e])
        assert torch.equal(s[e], s_e) and torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8))


def test_each_block_uses_the_full_range_and_dequantizes_within_e4m3_precision():
    x = _weights(200, 300)
    q, s = quantize_blockwise(x)
    for i in range(0, 200, 128):
        for j in range(0, 300, 128):
            assert q[i : i + 128, j : j + 128].float().abs().max().item() == E4M3_MAX
    error = (dequantize_blockwise(q, s) - x).abs()
    spread = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # 3 mantissa bits: half an ulp is 2^-4 relative; below e4m3's normals, half of 2^-9 absolute.
    assert (error <= x.abs() * 2**-4 + spread * 2**-10).all()


def test_zero_blocks_stay_zero_with_finite_scales_and_input_is_untouched():
    x = torch.zeros(130, 260)
    x[129, 259] = -3.0  # only the last edge block is nonzero
    before = x.clone()
    q, s = quantize_blockwise(x)
    assert torch.equal(x, before)
    assert torch.isfinite(s).all() and not q.float().isnan().any()
    assert q.float()[:128, :256].abs().max() == 0
    assert q.float()[129, 259] == -E4M3_MAX and s[1, 2] == torch.tensor(3.0) / E4M3_MAX


def test_bfloat16_weights_quantize_like_their_float32_values():
    x = _weights(200, 300).to(torch.bfloat16)
    q, s = quantize_blockwise(x)
    q32, s32 = quantize_blockwise(x.float())
    assert torch.equal(s, s32) and torch.equal(q.view(torch.uint8), q32.view(torch.uint8))


GATE = "model.layers.0.mlp.experts.gate_proj.weight"


@pytest.mark.parametrize(
    "shape, boxes",
    [
        (
            (8, 256, 200),
            [Box((0, 0, 0), (3, 128, 200)), Box((3, 128, 0), (8, 256, 200))],
        ),  # EP cut anywhere, TP at 128
        ((300, 200), [Box((0, 0), (256, 200)), Box((256, 0), (300, 200))]),  # edge block held whole
        ((300, 200), [Box((0, 0), (300, 200))]),
    ],
)
def test_block_aligned_source_shards_are_accepted(shape, boxes):
    require_whole_blocks(GATE, shape, [(f"trainer-{i}", b) for i, b in enumerate(boxes)])


@pytest.mark.parametrize(
    "shape, box, match",
    [
        (
            (8, 64, 200),
            Box((0, 0, 0), (8, 32, 200)),
            r"trainer-1 holds \[0:8, 0:32, 0:200\], whose bound 32 on dim 1",
        ),
        ((300, 200), Box((150, 0), (300, 200)), "bound 150 on dim 0 falls inside a 128x128 FP8 block"),
        ((300, 200), Box((0, 100), (300, 200)), "shard dim 1 at multiples of 128"),
    ],
)
def test_source_shards_that_cut_a_block_are_refused_naming_tensor_member_and_dim(shape, box, match):
    with pytest.raises(ValueError, match=rf"canonical tensor {GATE}: .*{match}"):
        require_whole_blocks(GATE, shape, [("trainer-1", box)])


# ---- planned and packed: bfloat16 trainer ranks into a blockwise-FP8 destination ----

E, I, H = 3, 256, 200  # H is not a multiple of 128: edge blocks on every projection
UP = "model.layers.0.mlp.experts.up_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"
SHAPES = {GATE: (E, I, H), UP: (E, I, H), O_PROJ: (H, I), NORM: (H,)}


def _declared(dtype: str) -> tuple[CanonicalTensor, ...]:
    return tuple(CanonicalTensor(n, s, dtype) for n, s in SHAPES.items())


def _trainer(rank: int, tp: int) -> Catalog:
    """Experts and o_proj sharded over tp on I (at multiples of 128), the norm replicated."""

    def shard(name: str, dim: int) -> Sharded:
        return Sharded(Canon(name, SHAPES[name]), (Shard(dim),), (tp,), (rank,))

    return Catalog(
        _declared("bfloat16"),
        (
            local_tensor("gate", "bfloat16", shard(GATE, 1)),
            local_tensor("up", "bfloat16", shard(UP, 1)),
            local_tensor("o_proj", "bfloat16", shard(O_PROJ, 1)),
            local_tensor("norm", "bfloat16", Canon(NORM, SHAPES[NORM])),
        ),
    )


def _vllm_like(rank: int, tp: int) -> Catalog:
    """A generator rank in vLLM's layout (fused w13 = [gate; up] per expert, row-parallel o_proj),
    in bfloat16; `blockwise_fp8_catalog` makes it the FP8 one."""

    def shard(name: str, dim: int) -> Sharded:
        return Sharded(Canon(name, SHAPES[name]), (Shard(dim),), (tp,), (rank,))

    return Catalog(
        _declared("bfloat16"),
        (
            local_tensor("w13_weight", "bfloat16", Concat(1, (shard(GATE, 1), shard(UP, 1)))),
            local_tensor("o_proj.weight", "bfloat16", shard(O_PROJ, 1)),
            local_tensor("norm", "bfloat16", Canon(NORM, SHAPES[NORM])),
        ),
    )


def test_the_fp8_catalog_declares_e4m3_weights_and_their_scales_on_the_block_grid():
    catalog = blockwise_fp8_catalog(_vllm_like(1, 2))
    declared = {c.name: (c.dtype, c.shape) for c in catalog.canonical}
    assert declared[GATE] == ("float8_e4m3fn", (E, I, H))
    assert declared[scale_name(GATE)] == ("float32", (E, 2, 2))
    assert declared[NORM] == ("bfloat16", (H,))
    tensors = {t.name: t for t in catalog.tensors}
    assert [t.name for t in catalog.tensors] == [
        "w13_weight",
        "w13_weight_scale_inv",
        "o_proj.weight",
        "o_proj.weight_scale_inv",
        "norm",
    ]
    scales = tensors["w13_weight_scale_inv"]
    assert scales.shape == (E, 2, 2) and scales.dtype == "float32"  # [gate block; up block] of rank 1
    assert [(p.canonical, p.canon) for p in scales.pieces] == [
        (scale_name(GATE), Box((0, 1, 0), (E, 2, 2))),
        (scale_name(UP), Box((0, 1, 0), (E, 2, 2))),
    ]


def test_an_fp8_layout_that_cuts_a_block_is_refused_naming_the_tensor():
    with pytest.raises(
        ValueError, match=rf"canonical tensor {GATE}: local tensor w13_weight holds .*bound 64 on dim 1"
    ):
        blockwise_fp8_catalog(_vllm_like(0, 4))  # I / 4 = 64 rows per rank


@pytest.mark.parametrize(
    "trainer_tp, generator_tp, bucket_bytes",
    [(2, 1, 1 << 20), (2, 2, 5000), (1, 2, 777)],
    ids=["tp2-into-tp1", "tp2-into-tp2-small-buckets", "tp1-into-tp2-odd-buckets"],
)
def test_fp8_destinations_receive_exactly_the_reference_quantization_of_the_trainers_weights(
    trainer_tp, generator_tp, bucket_bytes
):
    weights = {
        n: _weights(*s, seed=i).to(torch.bfloat16) if len(s) > 1 else torch.randn(s).to(torch.bfloat16)
        for i, (n, s) in enumerate(SHAPES.items())
    }
    sources = [SourceMember(f"trainer-{r}", 0, _trainer(r, trainer_tp)) for r in range(trainer_tp)]
    dests = [
        DestMember(f"generator-{r}", blockwise_fp8_catalog(_vllm_like(r, generator_tp)))
        for r in range(generator_tp)
    ]
    plan = make_plan(sources, dests, bucket_bytes=bucket_bytes)
    units = [u for b in plan.buckets for u in b.units]
    assert {u.quantized for u in units} == {None, "values", "scales"}
    assert all(u.dtype == "float8_e4m3fn" for u in units if u.quantized == "values")
    held = {
        m.member_id: catalog_views(
            m.catalog, {name: x.contiguous() for name, x in materialize_torch(m.catalog, weights).items()}
        )
        for m in sources
    }
    received = {
        m.member_id: {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for t in m.catalog.tensors}
        for m in dests
    }
    buffer = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    for bucket in plan.buckets:
        unpack_from(bucket, pack_into(bucket, held[bucket.src], buffer), received[bucket.dst])
    expected = checkpoint_arrays(weights)
    for m in dests:
        for name, want in materialize(m.catalog, expected).items():
            got = received[m.member_id][name]
            got = (
                got.view(torch.uint8 if got.element_size() == 1 else torch.int16)
                if got.dtype != torch.float32
                else got
            )
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{m.member_id} {name}")


def materialize_torch(catalog: Catalog, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`materialize` for torch tensors (NumPy has no bfloat16): bfloat16 through int16 bits."""
    bits = materialize(catalog, {n: x.view(torch.int16).numpy() for n, x in weights.items()})
    return {n: torch.from_numpy(a).view(torch.bfloat16) for n, a in bits.items()}


def test_trainer_shards_that_cut_a_block_are_refused_by_the_planner_naming_tensor_and_member():
    sources = [SourceMember(f"trainer-{r}", 0, _trainer(r, 4)) for r in range(4)]  # I / 4 = 64
    with pytest.raises(ValueError, match=rf"canonical tensor {GATE}: trainer-0 holds .*bound 64 on dim 1"):
        make_plan(sources, [DestMember("generator-0", blockwise_fp8_catalog(_vllm_like(0, 1)))])


def test_an_fp8_weight_without_its_scales_is_refused():
    fp8 = blockwise_fp8_catalog(_vllm_like(0, 1))
    no_scales = Catalog(
        tuple(c for c in fp8.canonical if not c.name.endswith("_scale_inv")),
        tuple(t for t in fp8.tensors if not t.name.endswith("_scale_inv")),
    )
    with pytest.raises(
        ValueError,
        match=(
            rf"canonical tensor {GATE}: generator-0 holds it as float8_e4m3fn "
            "but does not declare its block scales"
        ),
    ):
        make_plan([SourceMember("trainer-0", 0, _trainer(0, 1))], [DestMember("generator-0", no_scales)])


def test_quantized_units_survive_the_wire_format():
    from syncd.api.convert import unit_from_pb, unit_to_pb

    plan = make_plan(
        [SourceMember("trainer-0", 0, _trainer(0, 1))],
        [DestMember("generator-0", blockwise_fp8_catalog(_vllm_like(0, 1)))],
        bucket_bytes=5000,
    )
    for unit in (u for b in plan.buckets for u in b.units):
        assert unit_from_pb(unit_to_pb(unit)) == unit
