"""The reference blockwise FP8 quantizer: what a blockwise-FP8 generator must hold after a refit.

Per 128x128 block of the last two dims (edge blocks smaller; see `syncd.plan.fp8_blocks` for the
grid and for why a sender must hold whole blocks):

    amax           = max |x| over the block, in float32 (at least AMAX_FLOOR)
    weight_scale_inv = amax / 448                  (float32; 448 is e4m3's largest finite value)
    weight         = clamp(x / weight_scale_inv, -448, 448) cast to float8_e4m3fn (nearest even)

so `weight * weight_scale_inv` dequantizes, and every block's largest element maps to +-448. The
clamp is needed because the division can land a hair above 448, and torch casts anything beyond
e4m3's range to NaN. The floor keeps all-zero blocks finite (their weights quantize to 0).
Inputs of any float dtype are quantized from their float32 values.
"""

from __future__ import annotations

import torch

from syncd.plan.fp8_blocks import BLOCK, scale_shape

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight_fp8, weight_scale_inv)` of `weight` (`[..., N, K]`): e4m3 values of the same shape
    and float32 scales of shape `scale_shape(weight.shape)`. Pure: `weight` is not modified."""
    values, scale_inv = quantized_view(weight, block)
    return values.contiguous(), scale_inv


def quantized_view(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blockwise` with the values as a view (of a padded tensor when the dims are not
    multiples of the block): for a caller that copies them on anyway, like the sender's packing.

    Written for memory traffic (it is bandwidth-bound on GPUs): no float32 copy of the input (the
    amax is exact in the input's dtype; the division promotes each element to float32 as it reads
    it), no |x| temporary, the clamp in place."""
    blocks, (n, k) = _blocks(weight, block)
    scale_inv = _scales(blocks)
    q = (
        torch.div(blocks, scale_inv[..., :, None, :, None])
        .clamp_(-E4M3_MAX, E4M3_MAX)
        .to(torch.float8_e4m3fn)
    )
    rows, cols = scale_inv.shape[-2:]
    return q.view(*blocks.shape[:-4], rows * block[0], cols * block[1])[..., :n, :k], scale_inv


def block_scales(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """`quantize_blockwise(weight)[1]` without computing the values (one read of `weight`)."""
    return _scales(_blocks(weight, block)[0])


def _blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """`weight` as `[..., rows, block0, cols, block1]` blocks (float32 unless it is a 16-bit float),
    and its last two dims."""
    x = weight if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else weight.to(torch.float32)
    *lead, n, k = x.shape
    rows, cols = scale_shape(tuple(x.shape), block)[-2:]
    if (n, k) != (rows * block[0], cols * block[1]) or not x.is_contiguous():
        # Zero-pad the edge blocks to whole ones: padding never raises an amax, and is cut off after.
        padded = torch.zeros((*lead, rows * block[0], cols * block[1]), dtype=x.dtype, device=x.device)
        padded[..., :n, :k] = x
        x = padded
    return x.view(*lead, rows, block[0], cols, block[1]), (n, k)


def _scales(blocks: torch.Tensor) -> torch.Tensor:
    dims = (-3, -1)
    amax = (
        torch.maximum(blocks.amax(dim=dims), blocks.amin(dim=dims).neg())
        .to(torch.float32)
        .clamp_min(AMAX_FLOOR)
    )
    # A true division on every device: CUDA turns a division by a Python scalar into a
    # multiplication by its rounded reciprocal, which differs from the CPU in the last bit.
    return amax / torch.full_like(amax, E4M3_MAX)


def dequantize_blockwise(
    weight_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """float32 `weight_fp8 * weight_scale_inv`, each scale spread over its block."""
    n, k = weight_fp8.shape[-2:]
    spread = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight_fp8.to(torch.float32) * spread[..., :n, :k]
