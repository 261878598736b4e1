"""The merge arithmetic, defined once for the trainer's refits, its exports and any reference.

    merged = round_to(dtype, W + scale * sum_k B[..., :, k] (x) A[..., k, :]),  scale = alpha / rank

all in float32: each rank-one term is one float32 product per element, the terms are added in
order k = 0 .. rank-1, the sum is scaled and added to the float32 base, and the result is rounded
once (to nearest even) to the served dtype. No matmul: a BLAS kernel picks its summation order by
the matrix shapes, so a tensor-parallel shard and the whole tensor could round differently. Here
every element depends only on its own row of B and column of A, so any sharding of W (rows, columns,
experts) merges to the same bits as the whole tensor, and a reference merge of the whole
checkpoint is bit-exact with what the trainer's ranks send.
"""

from __future__ import annotations

import torch


def lora_delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B @ A in float32 over leading batch dims: A [..., r, in], B [..., out, r] -> [..., out, in]."""
    if a.shape[-2] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(
            f"LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not chain (A [..., r, in], B [..., out, r])"
        )
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    out = torch.zeros((*b.shape[:-1], a.shape[-1]), dtype=torch.float32, device=a.device)
    for k in range(a.shape[-2]):
        out += b32[..., :, k : k + 1] * a32[..., k : k + 1, :]
    return out


def merge_lora(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The merged weight in `dtype` (module docstring): `weight` [..., out, in] in any float dtype."""
    delta = lora_delta(a, b)
    if delta.shape != weight.shape:
        raise ValueError(f"LoRA B @ A is {tuple(delta.shape)}, the weight {tuple(weight.shape)}")
    return (weight.to(torch.float32) + delta * scale).to(dtype)
