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

import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

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
_FIELDS = 15  # the table's int64 fields per region, in the order `checksum_triton.reduce_regions` reads them
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


@functools.cache
def _kernels() -> ModuleType | None:
    """The Triton kernels (`checksum_triton`), imported the first time a CUDA tensor needs them;
    None without Triton (CPU-only installs: the torch form serves)."""
    try:
        from syncd.member.dataplane import checksum_triton
    except ImportError:
        return None
    return checksum_triton


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
    if not region.is_cuda or esize not in (1, 2, 4) or _kernels() is None:
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
        per_program = br * -(-min(max(wanted, br), most) // br)
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
        kernels = _kernels()
        assert kernels is not None, "regions are described only where the kernels import"
        self._reduce_regions = kernels.reduce_regions
        tl = kernels.tl
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
        self._reduce_regions[(self._programs,)](self._table, self._owners, **self._options)
