"""The GPU checksum's per-region reductions (`checksum.reduce_region`) as one Triton kernel that
reads regions once, where they lie, whatever their strides, many regions per launch.

The landed check (`syncd.member.dataplane.landed`) checksums each unit where it landed: a box of
a destination tensor, more than half of them strided (an expert range of a TP shard, say). The
torch form copies such a region contiguous first and then runs two reductions over the copy
(column sums, row sums), with a handful of launches per region: on the 24 x 128-expert model's
hundreds of units the host's launches alone took longer than the GPU's work. Measured on an H100
(`bench/landed_bench.py --device cuda`) it ran at 0.16-0.24 of a device-to-device copy's speed.

A region is the int32 matrix [rows, 1024] of its bytes in C order, as in `checksum`. `describe`
turns a region into numbers (address, dimensions collapsed to at most three, steps, element size:
whole aligned 32-bit words where the runs allow, else 1-, 2- or 4-byte elements); `reduce_batch`
uploads a table of them and launches one program per block of rows of every region. A program
computes where each element lies, shifts its bits to their place in its word and sums: each row's
sum, weighted by its number, into the region's int64 (a row lies in one program, so one atomic add
a program; int64 wraps as the host's fold does), column sums atomically into the region's [1024]
(wrapping int32 addition is exact and order-free, so the sums equal torch's). The bytes after the
last full row are copied out as they are, for the host's fold. A copy variant (`describe_copy`)
also writes each item it read to a destination of other strides, so a copy costs one read and
one write with its checksum. `Batch` keeps a list of regions' launches ready for refits whose
regions do not move.

Where an item lies takes divisions by the region's dimensions. 64-bit integer divisions (about
a hundred instructions each) once per program only; per row and, for runs shorter than a row, per
item, the quotients are small, so float32 estimates corrected by one step serve; for runs of a
row or more, an item's place is one choice between two starts; for short runs of one outer
index (a TP half of a vLLM MoE's `w2_weight`: 768-byte runs), one float32 quotient per item
with no correction step (on an H200 such regions went from 0.70 to 1.6 x a device-to-device
copy's speed, 2026-11-28); and where every run is whole rows (contiguous regions, most expert
slices), one start per row: 2.6-2.7 TB/s over 4 GB of
contiguous regions on an H100, 1.7-1.8 x a device-to-device copy's speed, against 2.4-2.6 with two
starts (bench/checksum_kernel_probe.py, 2026-11-26, in git history). (Per-row 64-bit divisions, done by
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
# A copy's tile: a quarter, so that its destination addresses fit beside the source's (on an H100,
# 4 GB of the colocated probe's units: 1,272-1,289 GB/s against 1,093 at 8192, 0.87-0.88 of a
# device-to-device copy; `bench/checksum_kernel_probe.py --copy-sweep`, 2026-11-26, in git history).
_COPY_ELEMENTS_PER_TILE = 2048
# Rows a program reads: as many as leave a launch about `_PROGRAMS` programs (several per SM of
# an H100 or H200, so that a bucket's few MiB still fill the GPU), up to 1 MiB (256 rows): each
# program pays its 64-bit divisions and 1,024 column-sum atomics once. On an H200, 1 GiB of
# contiguous bf16 checked at 1.68 x a device-to-device copy's speed with 256 rows and 4 warps, 1.41
# with 64 rows (the rows of this file's first version), 1.32 with 64 rows and 8 warps; 16 warps or
# larger tiles were slower (2026-11-28). A copy's programs stay at 64 rows (what was measured).
_PROGRAMS = 1024
_MAX_ROWS_PER_PROGRAM = 256
_COPY_ROWS_PER_PROGRAM = 64
_NUM_WARPS = 4
_VEC_BYTES = 16  # the widest load
_MAX_DIM = 1 << 30  # int32 arithmetic in the kernel: a dimension plus a row stays below 2**31
_FIELDS = 15  # the table's int64 fields per region, in the order `_reduce_regions` reads them
_SHORT_MAX = 1 << 19  # short runs (`_offsets`' FLAT): a row's span in items, and its float32 quotients


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
    # A copy (`describe_copy`): the kernel also writes each item it read here, in the same
    # place of the same dims, at these steps.
    dst: torch.Tensor | None = None
    dst_address: int = 0
    dst_steps: tuple[int, int] = (0, 0)

    @property
    def full_rows(self) -> int:
        return self.numel // ROW_BYTES

    @property
    def variant(self) -> tuple[int, bool, bool, bool, bool, int]:
        """The kernel's compile-time choices: item size, runs of a row or more, runs of whole
        rows (every row lies in one run), short runs of one outer index whose place within a
        row's span fits int32 (`_offsets`' FLAT), a copy, vector width."""
        items_per_row = ROW_BYTES // self.esize
        vec = _VEC_BYTES // self.esize
        steps = (*self.steps, *self.dst_steps, self.dims[2])
        aligned = self.address % _VEC_BYTES == 0 and self.dst_address % _VEC_BYTES == 0
        aligned = aligned and all(x % vec == 0 for x in steps)
        long_runs = self.dims[2] >= items_per_row
        whole_rows = long_runs and self.dims[2] % items_per_row == 0
        span = (items_per_row // self.dims[2] + 2) * max(self.steps[1], self.dst_steps[1])
        flat = not long_runs and self.dims[0] == 1 and span < _SHORT_MAX
        return self.esize, long_runs, whole_rows, flat, self.dst is not None, vec if aligned else 1


@dataclass(frozen=True)
class ReducedRegions:
    """`checksum.reduce_region`'s outputs for regions one after another: column sums [k, 1024];
    row sums of all, region by region (`row_counts` each); rest bytes, region i's `rest_counts[i]`
    of them at `rest_starts[i]`. The kernel weighs the row sums itself: `weighted_rows` [k] int64,
    each region's sum of (row number + 1) x row sum, and `rows` is then empty."""

    cols: torch.Tensor
    rows: torch.Tensor
    row_counts: np.ndarray
    rest: torch.Tensor
    rest_starts: np.ndarray
    rest_counts: np.ndarray
    weighted_rows: torch.Tensor | None = None

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
    dims, (steps,) = collapse_together(shape, strides)
    return dims, steps


def collapse_together(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """`collapse` of several tensors of one shape at once: a dimension is merged into the next only
    where it steps over it exactly in every one, so the same dims address each."""
    dims: list[int] = []
    steps: list[list[int]] = [[] for _ in strides]
    for i, size in enumerate(shape):
        if size == 1:
            continue
        if dims and all(st[-1] == tensor[i] * size for st, tensor in zip(steps, strides)):
            dims[-1] *= size
            for st, tensor in zip(steps, strides):
                st[-1] = tensor[i]
        else:
            dims.append(size)
            for st, tensor in zip(steps, strides):
                st.append(tensor[i])
    return dims or [1], [st or [1] for st in steps]


def describe(region: torch.Tensor) -> Region | None:
    return _describe(region, None)


def describe_copy(dst: torch.Tensor, src: torch.Tensor) -> Region | None:
    """`src` as the kernel reads it, and written to `dst` (same shape and dtype, no overlap) by
    the same pass: the checksum is then of the bytes copied, taken as they were written. None
    where `describe` would be None for either, or they cannot share dims."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
        return None
    return _describe(src, dst)


def _describe(region: torch.Tensor, dst: torch.Tensor | None) -> Region | None:
    esize = region.element_size()
    if triton is None or not region.is_cuda or esize not in (1, 2, 4):
        return None
    tensors = (region,) if dst is None else (region, dst)
    dims, all_steps = collapse_together(tuple(region.shape), *(tuple(t.stride()) for t in tensors))
    if len(dims) > 3 or any(st[-1] != 1 for st in all_steps) or max(dims) >= _MAX_DIM:
        return None
    dims = [1] * (3 - len(dims)) + dims
    all_steps = [[0] * (3 - len(st)) + st for st in all_steps]
    addresses, ratio = [t.data_ptr() for t in tensors], 4 // esize
    words = all(a % 4 == 0 for a in addresses) and all(
        x % ratio == 0 for x in (dims[2], *(s for st in all_steps for s in st[:2]))
    )
    if ratio > 1 and words:
        dims[2], esize = dims[2] // ratio, 4  # whole words
        all_steps = [[s // ratio for s in st] for st in all_steps]
    steps = (all_steps[0][0], all_steps[0][1])
    if dst is None:
        return Region(region, addresses[0], (dims[0], dims[1], dims[2]), steps, esize, region.nbytes)
    dst_steps = (all_steps[1][0], all_steps[1][1])
    return Region(
        region,
        addresses[0],
        (dims[0], dims[1], dims[2]),
        steps,
        esize,
        region.nbytes,
        dst,
        addresses[1],
        dst_steps,
    )


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
    def _reduce_regions(
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


def reduce_batch(regions: list[Region], whole_rows: bool = True) -> ReducedRegions:
    """`checksum.reduce_region`'s outputs of every region, enqueued on the current stream: one
    launch per kernel variant, one upload of the table, no per-region tensor on the host.
    `whole_rows` False: runs of whole rows addressed as any long runs (what the probe compares)."""
    return Batch(regions, whole_rows).launch()


class Batch:
    """`reduce_batch` of a fixed list of regions, ready to launch again: the tables are built and
    uploaded and the outputs allocated once, so a `launch` costs the host one kernel launch per
    variant (building them for the 39 regions of a 4 GB model took 1-2 ms of host time a refit on
    an H100 machine, as long as the kernels' own work). The regions' bytes may change between
    launches, not where they lie; each launch overwrites the outputs of the one before, so read
    them (`DeviceSums.values`) before launching again."""

    def __init__(self, regions: list[Region], whole_rows: bool = True) -> None:
        self.regions = regions  # kept: the kernels read (and a copy writes) their tensors
        device = regions[0].tensor.device
        numels = np.array([r.numel for r in regions], dtype=np.int64)
        row_counts = numels // ROW_BYTES
        rest_counts = numels - row_counts * ROW_BYTES
        rest_starts = np.concatenate([[0], np.cumsum((rest_counts + 3) // 4 * 4)])  # 4-byte aligned
        self._weighted = torch.zeros(len(regions), dtype=torch.int64, device=device)
        self.out = ReducedRegions(
            torch.zeros(len(regions), COLS, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            row_counts,
            torch.empty(int(rest_starts[-1]), dtype=torch.uint8, device=device),
            rest_starts[:-1],
            rest_counts,
            self._weighted,
        )
        index = np.arange(len(regions), dtype=np.int64)
        addresses = (
            self.out.cols.data_ptr() + 4 * COLS * index,
            self._weighted.data_ptr() + 8 * index,
            self.out.rest.data_ptr() + rest_starts[:-1],
        )
        by_variant: dict[tuple[int, bool, bool, bool, bool, int], list[int]] = {}
        for k, region in enumerate(regions):
            if region.numel:
                by_variant.setdefault(region.variant, []).append(k)
        self._launches = [
            _Launch(
                [regions[k] for k in members],
                [a[members] for a in addresses],
                esize,
                long_runs,
                whole and whole_rows,
                flat,
                copy,
                vec,
            )
            for (esize, long_runs, whole, flat, copy, vec), members in by_variant.items()
        ]
        self._fresh = True  # the sums are zero

    def launch(self) -> ReducedRegions:
        if not self._fresh:  # the atomic adds accumulate
            self.out.cols.zero_()
            self._weighted.zero_()
        self._fresh = False
        for launch in self._launches:
            launch.run()
        return self.out


class _Launch:
    """One kernel variant's launch over its regions: the table uploaded (`outputs`: each region's
    column sums, row sums and rest addresses), the launch's compile-time choices kept."""

    def __init__(
        self,
        regions: list[Region],
        outputs: list[np.ndarray],
        esize: int,
        long_runs: bool,
        whole_rows: bool,
        flat: bool,
        copy: bool,
        vec: int,
    ) -> None:
        br = max(1, (_COPY_ELEMENTS_PER_TILE if copy else _ELEMENTS_PER_TILE) * esize // ROW_BYTES)
        full_rows = np.array([r.full_rows for r in regions], dtype=np.int64)
        rest_n = np.array([r.numel for r in regions], dtype=np.int64) % ROW_BYTES // esize
        wanted = -(-int(full_rows.sum() + (rest_n > 0).sum()) // _PROGRAMS)
        most = _COPY_ROWS_PER_PROGRAM if copy else _MAX_ROWS_PER_PROGRAM
        per_program = br * triton.cdiv(min(max(wanted, br), most), br)
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
                np.array([r.dst_address for r in regions], dtype=np.int64),
                np.array([r.dst_steps[0] for r in regions], dtype=np.int64),
                np.array([r.dst_steps[1] for r in regions], dtype=np.int64),
            ],
            axis=1,
        )
        assert table.shape[1] == _FIELDS
        owners = np.repeat(np.arange(len(regions), dtype=np.int64), programs)
        values = np.concatenate([table.reshape(-1), owners])
        # Pinned (torch caches such blocks) and asynchronous: a pageable upload waits for the stream's work.
        host = torch.empty(values.size, dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = values
        self._table = host.to(regions[0].tensor.device, non_blocking=True)
        self._owners = self._table[table.size :]
        self._programs = int(owners.size)
        self._options = {
            "ITEM": {1: tl.uint8, 2: tl.int16, 4: tl.int32}[esize],
            "ESIZE": esize,
            "BR": br,
            "LONG_RUNS": long_runs,
            "WHOLE_ROWS": whole_rows,
            "FLAT": flat,
            "COPY": copy,
            "VEC": vec,
            "FIELDS": _FIELDS,
            "num_warps": _NUM_WARPS,
        }

    def run(self) -> None:
        _reduce_regions[(self._programs,)](self._table, self._owners, **self._options)
