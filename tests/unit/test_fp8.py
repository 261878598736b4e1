"""Blockwise FP8: the reference quantizer (edge blocks included) and the refusal of trainer shards
that cut a block."""

from __future__ import annotations

import pytest
import torch

from syncd.dataplane.fp8 import E4M3_MAX, dequantize_blockwise, quantize_blockwise
from syncd.layout import Box
from syncd.plan.fp8_blocks import require_whole_blocks, scale_shape


def _weights(*shape: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose spread differs by row, so blocks get different scales."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, shape[-2]).view(-1, 1)
    return torch.randn(shape, generator=gen) * rows


def _block_by_block(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's definition applied to one slice at a time (no padding, no reshapes)."""
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // block), -(-k // block))
    for i in range(0, n, block):
        for j in range(0, k, block):
            part = x[i : i + block, j : j + block].float()
            scale = max(part.abs().max().item(), 1e-12) / E4M3_MAX
            scale = torch.tensor(scale, dtype=torch.float32)
            s[i // block, j // block] = scale
            q[i : i + block, j : j + block] = (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 129), (77, 5)])
def test_quantizer_equals_the_block_by_block_definition_including_edge_blocks(shape):
    x = _weights(*shape)
    q, s = quantize_blockwise(x)
    ref_q, ref_s = _block_by_block(x)
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


@pytest.mark.parametrize("shape, boxes", [
    ((8, 256, 200), [Box((0, 0, 0), (3, 128, 200)), Box((3, 128, 0), (8, 256, 200))]),  # EP cut anywhere, TP at 128
    ((300, 200), [Box((0, 0), (256, 200)), Box((256, 0), (300, 200))]),  # edge block held whole
    ((300, 200), [Box((0, 0), (300, 200))]),
])
def test_block_aligned_source_shards_are_accepted(shape, boxes):
    require_whole_blocks(GATE, shape, [(f"trainer-{i}", b) for i, b in enumerate(boxes)])


@pytest.mark.parametrize("shape, box, match", [
    ((8, 64, 200), Box((0, 0, 0), (8, 32, 200)), r"trainer-1 holds \[0:8, 0:32, 0:200\], whose bound 32 on dim 1"),
    ((300, 200), Box((150, 0), (300, 200)), "bound 150 on dim 0 falls inside a 128x128 FP8 block"),
    ((300, 200), Box((0, 100), (300, 200)), "shard dim 1 at multiples of 128"),
])
def test_source_shards_that_cut_a_block_are_refused_naming_tensor_member_and_dim(shape, box, match):
    with pytest.raises(ValueError, match=rf"canonical tensor {GATE}: .*{match}"):
        require_whole_blocks(GATE, shape, [("trainer-1", box)])
