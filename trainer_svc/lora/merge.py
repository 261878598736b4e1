"""The merge arithmetic, defined once for the trainer's refits, its exports and any reference.

    merged = round_to(dtype, scale * sum_k B[..., :, k] (x) A[..., k, :] + W),  scale = alpha / rank

all in float32: each rank-one term is one float32 product per element (rounded, no fused
multiply-add), the terms are added in order k = 0 .. rank-1 starting from zero, the sum is scaled,
the base W (exact in float32) is added, and the result is rounded once (to nearest even) to the
served dtype. No matmul: a BLAS kernel picks its summation order by the matrix shapes, so a
tensor-parallel shard and the whole tensor could round differently. Here every element depends
only on its own row of B and column of A, so any sharding of W (rows, columns, experts) merges to
the same bits as the whole tensor, and a reference merge of the whole checkpoint is bit-exact with
what the trainer's ranks send. The work goes in blocks of rows that stay in cache (each element's
operations are the same whatever the block), so the rank's passes do not each stream the weight.
"""

from __future__ import annotations

import torch

_BLOCK_ELEMENTS = 1 << 15  # float32 elements per block of rows: 128 KiB, twice (sum and term)


def merge_lora(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The merged weight in `dtype` (module docstring). `weight` [..., out, in] in any float dtype,
    `a` [..., r, in], `b` [..., out, r] with the same leading (expert) dims."""
    *lead, out, inp = weight.shape
    r = a.shape[-2]
    if tuple(a.shape) != (*lead, r, inp) or tuple(b.shape) != (*lead, out, r):
        raise ValueError(
            f"LoRA factors A {tuple(a.shape)} and B {tuple(b.shape)} do not fit weight "
            f"{tuple(weight.shape)}: expected A [..., r, {inp}] and B [..., {out}, r]"
        )
    w3 = weight.reshape(-1, out, inp)
    a3, b3 = a.reshape(-1, r, inp).to(torch.float32), b.reshape(-1, out, r).to(torch.float32)
    result = torch.empty(w3.shape, dtype=dtype, device=weight.device)
    rows = max(1, min(out, _BLOCK_ELEMENTS // inp))
    total = torch.empty((rows, inp), dtype=torch.float32, device=weight.device)
    term = torch.empty_like(total)
    for n in range(w3.shape[0]):
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            acc, tmp = total[: r1 - r0], term[: r1 - r0]
            acc.zero_()
            for k in range(r):
                torch.mul(b3[n, r0:r1, k : k + 1], a3[n, k : k + 1, :], out=tmp)
                acc.add_(tmp)
            acc.mul_(scale).add_(w3[n, r0:r1])
            result[n, r0:r1].copy_(acc)
    return result.view(weight.shape)
