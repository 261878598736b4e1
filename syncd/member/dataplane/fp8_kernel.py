"""The blockwise-FP8 quantizer as one Triton kernel, for senders on NVIDIA GPUs: it reads each
128x128 block of the sender's weight once and writes its e4m3 values (or only its scale) straight
into the bucket, where the reference (`syncd.member.dataplane.fp8`) makes float32 temporaries of
the whole region (about 25 bytes of memory traffic per 2-byte input; this kernel about 3).

Same bytes as the reference, on purpose: the scale is amax / 448 with an IEEE division
(`div_rn`), each value is x / scale with an IEEE division, rounded to nearest even and saturated
to +-448 by the e4m3 conversion (the reference's clamp). `tests/gpu/test_conversion_gpu.py`
compares them with the CPU quantizer's bytes.

`available(t)` says whether a tensor can take this path (CUDA and Triton present); the packer
falls back to the reference otherwise.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from syncd.member.dataplane.fp8 import AMAX_FLOOR, E4M3_MAX
from syncd.plan.fp8_blocks import BLOCK

# Warps per 128 x 128 block (32 values a thread). On an H200 (2026-11-28), quantizing 400 MB of
# bf16 experts ran at 0.83 of a device-to-device copy of the input with 16 warps, 0.75 with 8 and
# 0.73 with 4; programs of two or more blocks, the next block's loads issued before this one's
# divisions, were slower (0.65-0.69 at 16 warps, below 0.2 at 4).
NUM_WARPS = 16


def available(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and _kernels() is not None


@functools.cache
def _kernels() -> ModuleType | None:
    """The Triton kernel (`fp8_triton`), imported the first time a CUDA tensor needs it; None
    without Triton (CPU-only installs: the reference quantizer serves)."""
    try:
        from syncd.member.dataplane import fp8_triton
    except ImportError:
        return None
    return fp8_triton


def quantize_into(x: torch.Tensor, values: torch.Tensor | None, scales: torch.Tensor) -> None:
    """Quantize `x` (`[..., N, K]`, any strides) blockwise: its e4m3 values into `values` (a
    contiguous float8_e4m3fn tensor of x's shape, or None for the scales only) and its scales
    into `scales` (contiguous float32 of `scale_shape(x.shape)`)."""
    *_, n, k = x.shape
    x3 = x.reshape(-1, n, k)  # a view when the leading dims allow it, else a copy
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    grid = (x3.shape[0] * rows * cols,)
    kernels = _kernels()
    assert kernels is not None, "`available` first"
    kernels.quantize_blocks[grid](
        x3,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        values if values is not None else scales,
        scales,
        n,
        k,
        cols,
        rows * cols,
        WRITE_VALUES=values is not None,
        BN=BLOCK[0],
        BK=BLOCK[1],
        QMAX=E4M3_MAX,
        FLOOR=AMAX_FLOOR,
        num_warps=NUM_WARPS,
    )
