"""The Triton kernel of `fp8_kernel`, in a module of its own: `fp8_kernel` imports it the first
time a CUDA tensor asks for it, so that processes with no GPU (each CPU trainer rank) do not pay
Triton's import, a quarter of a second. Its design is told in `fp8_kernel`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_blocks(
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
