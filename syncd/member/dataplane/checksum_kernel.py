"""The GPU checksum's per-region reductions (`checksum.reduce_region`) as one Triton kernel that
reads regions once, where they lie, whatever their strides, many regions per launch.

The landed check (`syncd.member.dataplane.landed`) checksums each unit where it landed: a box of
a destination tensor, more than half of them strided (an expert range of a TP shard, say). The
torch form copies such a region contiguous first and then runs two reductions over the copy
(column sums, row sums), with a handful of launches per region: on the 24 x 128-expert model's
hundreds of units the host's launches alone took longer than the GPU's work. Measured on an H100
(bench/landed_gpu_bench.py) it ran at 0.16-0.24 of a device-to-device copy's speed.

A region is the int32 matrix [rows, 1024] of its bytes in C order, as in `checksum`. `describe`
turns a region into numbers (address, dimensions collapsed to at most three, steps, element size:
whole aligned 32-bit words where the runs allow, else 1-, 2- or 4-byte elements); `reduce_batch`
uploads a table of them and launches one program per block of rows of every region. A program
computes where each element lies, shifts its bits to their place in its word and sums: row sums
are stored, column sums are added atomically to the region's [1024] (wrapping int32 addition is
exact and order-free, so the sums equal torch's). The bytes after the last full row are copied
out as they are, for the host's fold.

Where an item lies takes divisions by the region's dimensions. 64-bit integer divisions (about
a hundred instructions each) once per program only; per row and, for runs shorter than a row, per
item, the quotients are small, so float32 estimates corrected by one step serve; for runs of a
row or more, an item's place is one choice between two starts; and where every run is whole
rows (contiguous regions, most expert slices), one start per row: 2.6-2.7 TB/s over 4 GB of
contiguous regions on an H100, 1.7-1.8 x a device-to-device copy's speed, against 2.4-2.6 with two
starts (bench/checksum_kernel_probe.py, 2026-11-26). (Per-row 64-bit divisions, done by
every thread that holds part of the row, made a first version compute-bound at a quarter of the
memory's speed.)

`describe(region)` is None when a region cannot take this path (not CUDA, no Triton, element
size not 1, 2 or 4, more than three dimensions after collapsing, last stride not 1); `Checksums`
uses the torch form then. `tests/gpu/test_landed_gpu.py` compares both on many shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch form serves
    triton = None

COLS = 1024  # 32-bit words per row: `checksum._COLS`
ROW_BYTES = 4 * COLS
_ELEMENTS_PER_TILE = 8192  # a program's tile is [rows, row elements] of this many (registers)
_ROWS_PER_PROGRAM = 64  # 256 KiB a program: few column-sum atomics, and blocks enough to fill SMs
_NUM_WARPS = 8
_VEC_BYTES = 16  # the widest load
_MAX_DIM = 1 << 30  # int32 arithmetic in the kernel: a dimension plus a row stays below 2**31
_FIELDS = 12  # the table's int64 fields per region, in the order `_reduce_regions` reads them


@dataclass(frozen=True)
class Region:
    """A region as the kernel reads it: `dims` (3, the last contiguous) of `esize`-byte items
    at byte address `address`, `steps` in items; `numel` bytes in all."""

    tensor: torch.Tensor  # kept alive until the kernel has read it
    address: int
    dims: tuple[int, int, int]
    steps: tuple[int, int]
    esize: int
    numel: int

    @property
    def full_rows(self) -> int:
        return self.numel // ROW_BYTES

    @property
    def variant(self) -> tuple[int, bool, bool, int]:
        """The kernel's compile-time choices: item size, runs of a row or more, runs of whole
        rows (every row lies in one run), vector width."""
        items_per_row = ROW_BYTES // self.esize
        vec = _VEC_BYTES // self.esize
        aligned = self.address % _VEC_BYTES == 0 and all(x % vec == 0 for x in (*self.steps, self.dims[2]))
        long_runs = self.dims[2] >= items_per_row
        return self.esize, long_runs, long_runs and self.dims[2] % items_per_row == 0, vec if aligned else 1


@dataclass(frozen=True)
class ReducedRegions:
    """`checksum.reduce_region`'s outputs for regions one after another: column sums [k, 1024];
    row sums of all, region by region (`row_counts` each); rest bytes, region i's `rest_counts[i]`
    of them at `rest_starts[i]`."""

    cols: torch.Tensor
    rows: torch.Tensor
    row_counts: np.ndarray
    rest: torch.Tensor
    rest_starts: np.ndarray
    rest_counts: np.ndarray

    @classmethod
    def one(cls, cols: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor) -> ReducedRegions:
        return cls(
            cols.view(1, -1),
            rows,
            np.array([rows.numel()]),
            rest,
            np.zeros(1, np.int64),
            np.array([rest.numel()]),
        )


def collapse(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The fewest dimensions that address the same elements in the same C order: size-1
    dimensions dropped, and a dimension merged into the next when it steps over it exactly."""
    dims: list[int] = []
    steps: list[int] = []
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if dims and steps[-1] == stride * size:
            dims[-1] *= size
            steps[-1] = stride
        else:
            dims.append(size)
            steps.append(stride)
    return dims or [1], steps or [1]


def describe(region: torch.Tensor) -> Region | None:
    esize = region.element_size()
    if triton is None or not region.is_cuda or esize not in (1, 2, 4):
        return None
    dims, steps = collapse(tuple(region.shape), tuple(region.stride()))
    if len(dims) > 3 or steps[-1] != 1 or max(dims) >= _MAX_DIM:
        return None
    dims, steps = [1] * (3 - len(dims)) + dims, [0] * (3 - len(steps)) + steps
    address, ratio = region.data_ptr(), 4 // esize
    if ratio > 1 and address % 4 == 0 and all(x % ratio == 0 for x in (dims[2], steps[0], steps[1])):
        dims[2], steps, esize = dims[2] // ratio, [s // ratio for s in steps], 4  # whole words
    return Region(region, address, (dims[0], dims[1], dims[2]), (steps[0], steps[1]), esize, region.nbytes)


if triton is not None:

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
        VEC: tl.constexpr,
    ):
        """Where item j of row k lies, in items from the region's start; rows count from the
        program's first, whose first item is item `lane` of the run at (`outer`, `mid`)."""
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
        else:
            q, lane = _divmod_small(l0 + j, d2, 1.0 / d2.to(tl.float32))
            qa, b = _divmod_small(b0 + q, d1, 1.0 / d1.to(tl.float32))
            offset = (a0 + qa) * s0 + b.to(tl.int64) * s1 + lane
        if VEC > 1:  # runs and steps of whole aligned vectors: let the compiler load vectors
            offset = tl.max_contiguous(tl.multiple_of(offset, [1, VEC]), [1, VEC])
        return offset

    @triton.jit
    def _reduce_regions(
        table_ptr,
        owner_ptr,
        ITEM: tl.constexpr,
        ESIZE: tl.constexpr,
        BR: tl.constexpr,
        LONG_RUNS: tl.constexpr,
        WHOLE_ROWS: tl.constexpr,
        VEC: tl.constexpr,
        FIELDS: tl.constexpr,
    ):
        EPR: tl.constexpr = 4096 // ESIZE  # items per 4 KiB row
        PER_WORD: tl.constexpr = 4 // ESIZE
        pid = tl.program_id(0)
        field = table_ptr + tl.load(owner_ptr + pid) * FIELDS
        x_ptr = tl.load(field).to(tl.pointer_type(ITEM))
        cols_ptr = tl.load(field + 1).to(tl.pointer_type(tl.int32))
        rows_ptr = tl.load(field + 2).to(tl.pointer_type(tl.int32))
        rest_ptr = tl.load(field + 3).to(tl.pointer_type(ITEM))
        full_rows = tl.load(field + 4)
        rest_n = tl.load(field + 5)
        d1 = tl.load(field + 6).to(tl.int32)
        d2 = tl.load(field + 7).to(tl.int32)
        s0 = tl.load(field + 8)
        s1 = tl.load(field + 9)
        per_program = tl.load(field + 11)
        first = (pid - tl.load(field + 10)) * per_program  # this program's first row
        # Its first item, split by the region's dimensions: the kernel's only 64-bit divisions.
        runs = first * EPR // d2
        lane = (first * EPR - runs * d2).to(tl.int32)
        outer = runs // d1
        mid = (runs - outer * d1).to(tl.int32)
        j = tl.arange(0, EPR)[None, :]
        shift = ((j * ESIZE) % 4) * 8
        acc = tl.zeros((BR, 1024), dtype=tl.int32)  # column sums, folded across rows at the end
        for r in range(0, per_program, BR):
            k = r + tl.arange(0, BR)[:, None]  # [BR, 1]: rows from the program's first
            rows = first + k
            in_rows = rows < full_rows  # one value per row: the loads stay vectors
            ptrs = x_ptr + _offsets(
                k.to(tl.int32), j, lane, outer, mid, d1, d2, s0, s1, EPR, LONG_RUNS, WHOLE_ROWS, VEC
            )
            if VEC > 1:  # the base came from the table: say its alignment (bytes) too
                ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, VEC])
            x = tl.load(ptrs, mask=in_rows, other=0)
            if ESIZE == 4:
                words = x.to(tl.int32)
            else:  # each item's bits at their place in its word: the sum is the word
                v = (x.to(tl.int32) & ((1 << (8 * ESIZE)) - 1)) << shift
                words = tl.sum(tl.reshape(v, (BR, 1024, PER_WORD)), axis=2)
            tl.store(rows_ptr + rows, tl.sum(words, axis=1)[:, None], mask=in_rows)
            acc += words
        tl.atomic_add(cols_ptr + tl.arange(0, 1024), tl.sum(acc, axis=0))
        if (rest_n > 0) & (first <= full_rows) & (full_rows < first + per_program):
            # The bytes after the last full row (this program's block holds that row): as they are.
            k = (full_rows - first).to(tl.int32) + tl.zeros((1, 1), dtype=tl.int32)
            offset = _offsets(k, j, lane, outer, mid, d1, d2, s0, s1, EPR, LONG_RUNS, WHOLE_ROWS, 1)
            x = tl.load(x_ptr + offset, mask=j < rest_n, other=0)
            tl.store(rest_ptr + j, x, mask=j < rest_n)


def reduce_batch(regions: list[Region], whole_rows: bool = True) -> ReducedRegions:
    """`checksum.reduce_region`'s outputs of every region, enqueued on the current stream: one
    launch per kernel variant, one upload of the table, no per-region tensor on the host.
    `whole_rows` False: runs of whole rows addressed as any long runs (what the probe compares)."""
    device = regions[0].tensor.device
    numels = np.array([r.numel for r in regions], dtype=np.int64)
    row_counts = numels // ROW_BYTES
    rest_counts = numels - row_counts * ROW_BYTES
    rest_starts = np.concatenate([[0], np.cumsum((rest_counts + 3) // 4 * 4)])  # 4-byte aligned
    rows_starts = np.concatenate([[0], np.cumsum(row_counts)])
    out = ReducedRegions(
        torch.zeros(len(regions), COLS, dtype=torch.int32, device=device),
        torch.empty(int(rows_starts[-1]), dtype=torch.int32, device=device),
        row_counts,
        torch.empty(int(rest_starts[-1]), dtype=torch.uint8, device=device),
        rest_starts[:-1],
        rest_counts,
    )
    addresses = (
        out.cols.data_ptr() + 4 * COLS * np.arange(len(regions), dtype=np.int64),
        out.rows.data_ptr() + 4 * rows_starts[:-1],
        out.rest.data_ptr() + rest_starts[:-1],
    )
    by_variant: dict[tuple[int, bool, bool, int], list[int]] = {}
    for k, region in enumerate(regions):
        if region.numel:
            by_variant.setdefault(region.variant, []).append(k)
    for (esize, long_runs, whole, vec), members in by_variant.items():
        variant = (esize, long_runs, whole and whole_rows, vec)
        _launch([regions[k] for k in members], [a[members] for a in addresses], *variant)
    return out


def _launch(
    regions: list[Region], outputs: list[np.ndarray], esize: int, long_runs: bool, whole_rows: bool, vec: int
) -> None:
    """One launch over `regions` (one variant); `outputs`: each region's column sums, row sums and
    rest addresses."""
    br = max(1, _ELEMENTS_PER_TILE * esize // ROW_BYTES)
    per_program = br * triton.cdiv(_ROWS_PER_PROGRAM, br)
    full_rows = np.array([r.full_rows for r in regions], dtype=np.int64)
    rest_n = np.array([r.numel for r in regions], dtype=np.int64) % ROW_BYTES // esize
    programs = -(-(full_rows + (rest_n > 0)) // per_program)  # the rest is a last, partial row
    first_program = np.concatenate([[0], np.cumsum(programs)[:-1]])
    table = np.stack(
        [
            np.array([r.address for r in regions], dtype=np.int64),
            *outputs,
            full_rows,
            rest_n,
            np.array([r.dims[1] for r in regions], dtype=np.int64),
            np.array([r.dims[2] for r in regions], dtype=np.int64),
            np.array([r.steps[0] for r in regions], dtype=np.int64),
            np.array([r.steps[1] for r in regions], dtype=np.int64),
            first_program,
            np.full(len(regions), per_program, dtype=np.int64),
        ],
        axis=1,
    )
    assert table.shape[1] == _FIELDS
    owners = np.repeat(np.arange(len(regions), dtype=np.int64), programs)
    values = np.concatenate([table.reshape(-1), owners])
    # Pinned (torch caches such blocks) and asynchronous: a pageable upload waits for the stream's work.
    host = torch.empty(values.size, dtype=torch.int64, pin_memory=True)
    host.numpy()[:] = values
    uploaded = host.to(regions[0].tensor.device, non_blocking=True)
    _reduce_regions[(owners.size,)](
        uploaded,
        uploaded[table.size :],
        ITEM={1: tl.uint8, 2: tl.int16, 4: tl.int32}[esize],
        ESIZE=esize,
        BR=br,
        LONG_RUNS=long_runs,
        WHOLE_ROWS=whole_rows,
        VEC=vec,
        FIELDS=_FIELDS,
        num_warps=_NUM_WARPS,
    )
