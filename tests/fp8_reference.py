"""Blockwise FP8 as the tests define it, apart from the project's quantizer
(`syncd.member.dataplane.fp8`): one 128x128 block at a time, no padding, no reshapes.

    scale  = max(|block|, 1e-12) / 448        (float32; 448: e4m3's largest finite value)
    values = clamp(block / scale, -448, 448)  cast to float8_e4m3fn
"""

from __future__ import annotations

import numpy as np
import torch

E4M3_MAX = 448.0
BLOCK = 128


def block_by_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales) of a 2-D tensor, from its float32 values."""
    n, k = x.shape
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // BLOCK), -(-k // BLOCK))
    for i in range(0, n, BLOCK):
        for j in range(0, k, BLOCK):
            part = x[i : i + BLOCK, j : j + BLOCK].float()
            scale = part.abs().max().clamp_min(1e-12) / torch.tensor(E4M3_MAX)
            scales[i // BLOCK, j // BLOCK] = scale
            values[i : i + BLOCK, j : j + BLOCK] = (
                (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            )
    return values, scales


def per_matrix(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_by_block` of a matrix, or of each expert's matrix of an `[E, N, K]` tensor."""
    if x.dim() == 2:
        return block_by_block(x)
    grids = [block_by_block(m) for m in x]
    return torch.stack([v for v, _ in grids]), torch.stack([s for _, s in grids])


def checkpoint_arrays(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The FP8 checkpoint of bfloat16 canonical `weights` as NumPy arrays (for
    `syncd.plan.simulate.materialize`): the quantized ones (`is_quantized`) as e4m3 bytes plus
    float32 `<name>_scale_inv`, the others as their bfloat16 bits (int16; NumPy has no bfloat16)."""
    from syncd.plan.fp8_blocks import is_quantized, scale_name

    out = {}
    for name, x in weights.items():
        if not is_quantized(name):
            out[name] = x.view(torch.int16).numpy()
            continue
        values, scales = per_matrix(x)
        out[name] = values.view(torch.uint8).numpy()
        out[scale_name(name)] = scales.numpy()
    return out
