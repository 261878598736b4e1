"""The Triton kernels of `checksum_kernel`, in a module of their own: importing Triton costs a
quarter of a second, and every process that imports the data plane (each trainer rank, each
member) would pay it, on machines with no GPU too. `checksum_kernel` imports this module the first
time it describes a CUDA tensor; the design of the kernels is told there."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _divmod_small(t, d, inv_d):
    """(t // d, t % d) for 0 <= t < 2**31 and a small quotient: float32's estimate is then
    off by at most one, which one step corrects."""
    q = (t.to(tl.float32) * inv_d).to(tl.int32)
    r = t - q * d
    low = r < 0
    q = tl.where(low, q - 1, q)
    r = tl.where(low, r + d, r)
    high = r >= d
    q = tl.where(high, q + 1, q)
    r = tl.where(high, r - d, r)
    return q, r


@triton.jit
def _offsets(
    k,
    j,
    lane,
    outer,
    mid,
    d1,
    d2,
    s0,
    s1,
    EPR: tl.constexpr,
    LONG_RUNS: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
    FLAT: tl.constexpr,
    VEC: tl.constexpr,
):
    """Where item j of row k lies, in items from the region's start; rows count from the
    program's first, whose first item is item `lane` of the run at (`outer`, `mid`).
    `FLAT`: short runs of one outer index (`dims[0]` 1; `Region.variant` says when)."""
    # Each row's first item, split by the region's dimensions once per row; the quotients
    # are small (at most a program's items over a run), so float32 serves ...
    q, l0 = _divmod_small(lane + k * EPR, d2, 1.0 / d2.to(tl.float32))
    qa, b0 = _divmod_small(mid + q, d1, 1.0 / d1.to(tl.float32))
    a0 = outer + qa
    # ... and each item from there: with runs of a row or more, one choice of two starts;
    # with shorter ones, two small divisions again.
    if WHOLE_ROWS:  # runs of whole rows: a row lies in one run, its items one after another
        offset = (a0 * s0 + b0.to(tl.int64) * s1 + l0) + j
    elif LONG_RUNS:  # a row lies in at most two runs: the one it starts in and the next
        left = d2 - l0  # items of the first run in this row
        nb = b0 + 1
        na = a0 + (nb >= d1).to(tl.int64)
        nb = tl.where(nb >= d1, 0, nb)
        start = a0 * s0 + b0.to(tl.int64) * s1 + l0
        next_start = na * s0 + nb.to(tl.int64) * s1 - left
        offset = tl.where(j < left, start, next_start) + j
    elif FLAT:  # short runs, one after another at steps s1: one small quotient per item
        # Item j is (l0 + j) // d2 runs after the row's first: `s1 - d2` items further than
        # its place in the row for each. The reciprocal, rounded up a little, makes the
        # float32 quotient exact for l0 + j < 2**19 (`_SHORT_MAX`), so no correction step:
        # the items' address arithmetic was the check's limit on these regions (a third
        # of a vLLM MoE's expert bytes: the TP halves of `w2_weight`).
        t = l0 + j
        q = (t.to(tl.float32) * ((1.0 / d2.to(tl.float32)) * 1.000001)).to(tl.int32)
        offset = (b0.to(tl.int64) * s1 + l0) + (j + q * (s1 - d2).to(tl.int32))
    else:
        q, lane = _divmod_small(l0 + j, d2, 1.0 / d2.to(tl.float32))
        qa, b = _divmod_small(b0 + q, d1, 1.0 / d1.to(tl.float32))
        offset = (a0 + qa) * s0 + b.to(tl.int64) * s1 + lane
    if VEC > 1:  # runs and steps of whole aligned vectors: let the compiler load vectors
        offset = tl.max_contiguous(tl.multiple_of(offset, [1, VEC]), [1, VEC])
    return offset


@triton.jit
def reduce_regions(
    table_ptr,
    owner_ptr,
    ITEM: tl.constexpr,
    ESIZE: tl.constexpr,
    BR: tl.constexpr,
    LONG_RUNS: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
    FLAT: tl.constexpr,
    COPY: tl.constexpr,
    VEC: tl.constexpr,
    FIELDS: tl.constexpr,
):
    EPR: tl.constexpr = 4096 // ESIZE  # items per 4 KiB row
    PER_WORD: tl.constexpr = 4 // ESIZE
    pid = tl.program_id(0)
    field = table_ptr + tl.load(owner_ptr + pid) * FIELDS
    x_ptr = tl.load(field).to(tl.pointer_type(ITEM))
    cols_ptr = tl.load(field + 1).to(tl.pointer_type(tl.int32))
    wrows_ptr = tl.load(field + 2).to(tl.pointer_type(tl.int64))
    rest_ptr = tl.load(field + 3).to(tl.pointer_type(ITEM))
    full_rows = tl.load(field + 4)
    rest_n = tl.load(field + 5)
    d1 = tl.load(field + 6).to(tl.int32)
    d2 = tl.load(field + 7).to(tl.int32)
    s0 = tl.load(field + 8)
    s1 = tl.load(field + 9)
    per_program = tl.load(field + 11)
    y_ptr = tl.load(field + 12).to(tl.pointer_type(ITEM))  # a copy's destination
    t0 = tl.load(field + 13)
    t1 = tl.load(field + 14)
    first = (pid - tl.load(field + 10)) * per_program  # this program's first row
    # Its first item, split by the region's dimensions: the kernel's only 64-bit divisions.
    runs = first * EPR // d2
    lane = (first * EPR - runs * d2).to(tl.int32)
    outer = runs // d1
    mid = (runs - outer * d1).to(tl.int32)
    j = tl.arange(0, EPR)[None, :]
    shift = ((j * ESIZE) % 4) * 8
    acc = tl.zeros((BR, 1024), dtype=tl.int32)  # column sums, folded across rows at the end
    # Each row's sum times its number (+1), wrapping as the host's int64 fold does: a row lies
    # in one program, so the weighted sum is one atomic add per program (a fold of millions of
    # stored row sums after the kernel cost 0.45 ms of a 4 GB check on an H100).
    weighted = tl.zeros((BR,), dtype=tl.int64)
    for r in range(0, per_program, BR):
        k = r + tl.arange(0, BR)[:, None]  # [BR, 1]: rows from the program's first
        rows = first + k
        in_rows = rows < full_rows  # one value per row: the loads stay vectors
        ptrs = x_ptr + _offsets(
            k.to(tl.int32), j, lane, outer, mid, d1, d2, s0, s1, EPR, LONG_RUNS, WHOLE_ROWS, FLAT, VEC
        )
        if VEC > 1:  # the base came from the table: say its alignment (bytes) too
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, VEC])
        x = tl.load(ptrs, mask=in_rows, other=0)
        if COPY:  # the same items, at the same places of the destination's steps
            dptrs = y_ptr + _offsets(
                k.to(tl.int32), j, lane, outer, mid, d1, d2, t0, t1, EPR, LONG_RUNS, WHOLE_ROWS, FLAT, VEC
            )
            if VEC > 1:
                dptrs = tl.max_contiguous(tl.multiple_of(dptrs, [1, 16]), [1, VEC])
            tl.store(dptrs, x, mask=in_rows)
        if ESIZE == 4:
            words = x.to(tl.int32)
        else:  # each item's bits at their place in its word: the sum is the word
            v = (x.to(tl.int32) & ((1 << (8 * ESIZE)) - 1)) << shift
            words = tl.sum(tl.reshape(v, (BR, 1024, PER_WORD)), axis=2)
        number = first + r + tl.arange(0, BR)  # masked rows loaded zeros: their sums are 0
        weighted += tl.sum(words, axis=1).to(tl.int64) * (number + 1)
        acc += words
    tl.atomic_add(cols_ptr + tl.arange(0, 1024), tl.sum(acc, axis=0))
    tl.atomic_add(wrows_ptr, tl.sum(weighted, axis=0))
    if (rest_n > 0) & (first <= full_rows) & (full_rows < first + per_program):
        # The bytes after the last full row (this program's block holds that row): as they are.
        k = (full_rows - first).to(tl.int32) + tl.zeros((1, 1), dtype=tl.int32)
        offset = _offsets(k, j, lane, outer, mid, d1, d2, s0, s1, EPR, LONG_RUNS, WHOLE_ROWS, FLAT, 1)
        x = tl.load(x_ptr + offset, mask=j < rest_n, other=0)
        tl.store(rest_ptr + j, x, mask=j < rest_n)
        if COPY:
            offset = _offsets(k, j, lane, outer, mid, d1, d2, t0, t1, EPR, LONG_RUNS, WHOLE_ROWS, FLAT, 1)
            tl.store(y_ptr + offset, x, mask=j < rest_n)
