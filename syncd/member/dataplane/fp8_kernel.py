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

import torch

from syncd.member.dataplane.fp8 import AMAX_FLOOR, E4M3_MAX
from syncd.plan.fp8_blocks import BLOCK

# Warps per 128 x 128 block (32 values a thread). On an H200 (2026-11-28), quantizing 400 MB of
# bf16 experts ran at 0.83 of a device-to-device copy of the input with 16 warps, 0.75 with 8 and
# 0.73 with 4; programs of two or more blocks, the next block's loads issued before this one's
# divisions, were slower (0.65-0.69 at 16 warps, below 0.2 at 4).
NUM_WARPS = 16

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference quantizer serves
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _quantize_blocks(
        x_ptr,
        sx_l,
        sx_n,
        sx_k,
        q_ptr,
        s_ptr,
        n,
        k,
        cols,
        blocks_per_matrix,
        WRITE_VALUES: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        QMAX: tl.constexpr,
        FLOOR: tl.constexpr,
    ):
        pid = tl.program_id(0)
        matrix = (pid // blocks_per_matrix).to(tl.int64)  # offsets past 2**31 elements
        block = pid % blocks_per_matrix
        r0 = (block // cols) * BN
        c0 = (block % cols) * BK
        rows = r0 + tl.arange(0, BN)[:, None]
        cs = c0 + tl.arange(0, BK)[None, :]
        mask = (rows < n) & (cs < k)
        # The block stays in its own dtype in registers (half the registers of float32 for 16-bit
        # weights); |x|'s maximum is exact in any float dtype.
        x = tl.load(x_ptr + matrix * sx_l + rows * sx_n + cs * sx_k, mask=mask, other=0.0)
        amax = tl.maximum(tl.max(tl.abs(x)).to(tl.float32), FLOOR)
        scale = tl.math.div_rn(amax, tl.full((), QMAX, tl.float32))
        tl.store(s_ptr + pid, scale)
        if WRITE_VALUES:
            # No clamp before the cast: the conversion saturates (PTX `cvt.rn.satfinite.e4m3x2`,
            # what Triton emits for float32 to e4m3), which is the reference's clamp to +-448.
            q = tl.math.div_rn(x.to(tl.float32), scale)
            tl.store(q_ptr + matrix * n * k + rows * k + cs, q.to(tl.float8e4nv), mask=mask)


def quantize_into(x: torch.Tensor, values: torch.Tensor | None, scales: torch.Tensor) -> None:
    """Quantize `x` (`[..., N, K]`, any strides) blockwise: its e4m3 values into `values` (a
    contiguous float8_e4m3fn tensor of x's shape, or None for the scales only) and its scales
    into `scales` (contiguous float32 of `scale_shape(x.shape)`)."""
    *_, n, k = x.shape
    x3 = x.reshape(-1, n, k)  # a view when the leading dims allow it, else a copy
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    grid = (x3.shape[0] * rows * cols,)
    _quantize_blocks[grid](
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
