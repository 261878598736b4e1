"""Checksums of transferred regions, computed identically on sender and receiver.

Both ends of a group use the same device type, so each uses the fastest strong-enough check there:
- CPU: xxh3-64 of the bytes (`xxhash`, ~10-25 GB/s on one core here where zlib's CRC-32 ran at
  2-3 GB/s; it releases the GIL, so the executor hashes one bucket on a worker thread while the
  next one is packed or unpacked and the wire moves a third).
- GPU: the region's 32-bit words seen as a [rows, 1024] matrix; index-weighted sums of its column
  sums and of its row sums, plus the words and bytes left over. The two big reductions accumulate
  in wrapping int32 so the data is never copied to a wider type; they are bandwidth-bound and
  catch corrupted, dropped and misplaced words.
  Cost per region is two reduction kernels (and a small copy when the size is not a multiple of
  4 KiB); everything else (weights, segment sums) runs once per transfer in `result()`, in a
  fixed number of kernels, and the sums are read back once, because a host read per region would
  stall the pipeline. (A one-pass Triton kernel computing both sums was measured on 2x H200 and
  was no faster inside a refit; see
  bench/reports/2026-11-23-data-plane-host-work.md.)
The text form starts with the algorithm, so mismatched algorithms can never compare equal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from syncd.member.dataplane import checksum_kernel
from syncd.member.dataplane.checksum_kernel import ReducedRegions, collapse

_COLS = checksum_kernel.COLS
_ROW_BYTES = checksum_kernel.ROW_BYTES
# On CPU a run this long is hashed where it lies (xxh3 streams): the hash call costs under a tenth
# of copying it; shorter runs are copied together first.
LONG_RUN_BYTES = 4096


def _xxh3(region_bytes: torch.Tensor) -> str:
    return _format_xxh3(region_bytes.numel(), xxhash.xxh3_64_intdigest(region_bytes.numpy().data))


def _format_xxh3(nbytes: int, digest: int) -> str:
    return f"xxh3:{nbytes:x}:{digest:016x}"


def long_runs(region: torch.Tensor, min_bytes: int) -> list[torch.Tensor] | None:
    """`region`'s bytes in C order as its contiguous runs (uint8 views), or None when it has more
    than one run and they are shorter than `min_bytes`."""
    dims, steps = collapse(tuple(region.shape), tuple(region.stride()))
    if len(dims) == 1 and steps[0] == 1:
        return [region.reshape(-1).view(torch.uint8)]
    if steps[-1] != 1 or dims[-1] * region.element_size() < min_bytes:
        return None
    starts = (
        region.storage_offset() + sum(i * s for i, s in zip(index, steps))
        for index in itertools.product(*(range(d) for d in dims[:-1]))
    )
    return [region.as_strided((dims[-1],), (1,), start).view(torch.uint8) for start in starts]


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64 on `device` (the weights of every fold). Made anew by each fold, twice per
    transfer, not kept in a module-level cache: one bandwidth-bound kernel of 8 bytes per 4 KiB
    row transferred, next to the transfer itself."""
    return torch.arange(1, n + 1, dtype=torch.int64, device=device)


def _weighted(values: np.ndarray) -> int:
    """sum((i + 1) * v_i) modulo 2**64, as the device computes it (numpy int64 wraps too)."""
    with np.errstate(over="ignore"):
        return int((values.astype(np.int64) * np.arange(1, values.size + 1, dtype=np.int64)).sum())


def region_outputs(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (column sums [1024] int32, row sums [rows] int32, rest bytes) for a region of `numel`
    bytes: what `reduce_region` writes."""
    rows = numel // _ROW_BYTES
    return (
        torch.empty(_COLS, dtype=torch.int32, device=device),
        torch.empty(rows, dtype=torch.int32, device=device),
        torch.empty(numel - rows * _ROW_BYTES, dtype=torch.uint8, device=device),
    )


def reduce_region(
    region_bytes: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor
) -> None:
    """The per-region work of the GPU algorithm, into outputs the caller owns (so that a CUDA graph
    can capture it): the region's full 4 KiB rows as an int32 [rows, 1024] matrix, its column
    and row sums, and a copy of the bytes after the last full row (the staging buffer is reused
    once the reductions are done)."""
    full = rows.numel() * _ROW_BYTES
    matrix = region_bytes[:full].view(torch.int32).view(-1, _COLS)
    torch.sum(matrix, dim=0, dtype=torch.int32, out=cols)
    torch.sum(matrix, dim=1, dtype=torch.int32, out=rows)
    if rest.numel():
        rest.copy_(region_bytes[full:])


class DeviceSums:
    """The GPU algorithm (plain torch, so it also runs on CPU tensors in tests): per region, the
    column and row sums are launched at once and kept on the device; `values()` weights and
    folds them for all regions together. Regions read in place (`checksum_kernel`) wait in
    `_pending` until `flush`, which reduces them in one batch."""

    def __init__(self) -> None:
        self.numels: list[int] = []
        self._reduced: list[ReducedRegions] = []  # in `add` order, one per region or batch
        self._pending: list[checksum_kernel.Region] = []

    def add_in_place(self, region: checksum_kernel.Region) -> None:
        """A region read where it lies by `checksum_kernel`, batched with the others added
        until `flush` (`values` flushes)."""
        self._pending.append(region)
        self.numels.append(region.numel)

    def flush(self) -> None:
        """Enqueue the pending in-place regions' reductions on the current stream, in one batch."""
        if self._pending:
            self._reduced.append(checksum_kernel.reduce_batch(self._pending))
            self._pending = []

    def add(self, region_bytes: torch.Tensor) -> None:
        n = region_bytes.numel()
        cols, rows, rest = region_outputs(n, region_bytes.device)
        reduce_region(region_bytes, cols, rows, rest)
        self.add_reduced(n, cols, rows, rest)

    def add_batch(self, batch: checksum_kernel.Batch) -> None:
        """A prepared batch's regions, launched now on the current stream."""
        self.flush()  # the batch before it keeps its place
        self.numels.extend(r.numel for r in batch.regions)
        self._reduced.append(batch.launch())

    def add_reduced(self, numel: int, cols: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor) -> None:
        """A region of `numel` bytes whose `reduce_region` outputs are already enqueued (by
        `add`, or by a replayed CUDA graph that wrote them)."""
        self.flush()  # the batch before it keeps its place
        self.numels.append(numel)
        self._reduced.append(ReducedRegions.one(cols, rows, rest))

    def _row_values(self, device: torch.device) -> torch.Tensor:
        """Each region's weighted row sum: the kernel's own, or folded here from stored row sums."""
        stored = [r for r in self._reduced if r.weighted_rows is None]
        folded = self._weighted_row_sums(stored, device) if stored else None
        parts, at = [], 0
        for r in self._reduced:
            if r.weighted_rows is not None:
                parts.append(r.weighted_rows)
            else:
                assert folded is not None
                parts.append(folded[at : at + len(r.row_counts)])
                at += len(r.row_counts)
        return torch.cat(parts)

    @staticmethod
    def _weighted_row_sums(reduced: list[ReducedRegions], device: torch.device) -> torch.Tensor:
        """Per region k with rows r_k[0..n_k): sum_j (j + 1) * r_k[j], for all regions at once.
        With g the global row number (1-based) and s_k the rows before region k, (j + 1) = g - s_k,
        so the sum is G_k - s_k * R_k with G, R segment sums of g * r and r: one cumulative sum of
        both, read at the region boundaries. (A scatter-add of millions of rows costs a millisecond
        more, and the fold runs after the last bucket, on the refit's critical path.)"""
        counts = np.concatenate([r.row_counts for r in reduced])
        total = int(counts.sum())
        if not total:
            return torch.zeros(len(counts), dtype=torch.int64, device=device)
        bounds = np.cumsum(np.concatenate([[0], counts]))  # [starts..., last end]
        rows = torch.cat([r.rows for r in reduced]).to(torch.int64)
        # One flat scan of [g * r, r] (a 1-D scan; a scan along rows of a 2-row matrix runs on two
        # thread blocks and takes milliseconds), read at both halves' region boundaries.
        flat = torch.cat([rows * _positions(total, device), rows])
        cum = torch.nn.functional.pad(torch.cumsum(flat, dim=0), (1, 0))  # cum[i] = sum of the first i
        at = cum[torch.from_numpy(np.concatenate([bounds, bounds + total])).to(device)].view(2, -1)
        seg = at[:, 1:] - at[:, :-1]
        return seg[0] - at.new_tensor(bounds[:-1]) * seg[1]

    def _rests(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every region's rest bytes in one host array, with each region's start and count."""
        sizes = [r.rest.numel() for r in self._reduced]
        bases = np.cumsum([0, *sizes[:-1]])
        starts = np.concatenate([r.rest_starts + b for r, b in zip(self._reduced, bases)])
        counts = np.concatenate([r.rest_counts for r in self._reduced])
        if not counts.any():
            return np.zeros(0, np.uint8), starts, counts
        return torch.cat([r.rest for r in self._reduced]).cpu().numpy(), starts, counts

    def values(self) -> list[tuple[int, int, int]]:
        """(weighted column sums, weighted row sums, weighted rest) per region, in `add` order,
        each as an unsigned 64-bit value (the int64 sums' bits)."""
        self.flush()
        if not self.numels:
            return []
        device = self._reduced[0].cols.device
        cols = torch.cat([r.cols for r in self._reduced]).to(torch.int64)
        col_sums = (cols * _positions(_COLS, device)).sum(dim=1)
        row_sums = self._row_values(device)
        # One read-back, as unsigned: formatting hundreds of regions' values stays a C loop
        # (per region in Python it cost the landed check of a 5 GB model 0.5 ms after its kernel).
        both = torch.stack([col_sums, row_sums]).cpu().numpy().view(np.uint64)
        col_list, row_list = both.tolist()
        rests = [0] * len(col_list)
        rest_bytes, starts, counts = self._rests()
        for i in np.flatnonzero(counts).tolist():  # the few regions with bytes after their last row
            tail = rest_bytes[starts[i] : starts[i] + counts[i]]
            words = tail[: tail.size - tail.size % 4].view("<i4")
            rest = np.concatenate([words.astype(np.int64), tail[words.size * 4 :].astype(np.int64)])
            rests[i] = _weighted(rest) & _MASK
        return list(zip(col_list, row_list, rests))


_MASK = 0xFFFFFFFFFFFFFFFF


def _format_gpu(numel: int, row: tuple[int, int, int]) -> str:
    col, rows, rest = row  # unsigned 64-bit (`DeviceSums.values`)
    return f"sums:{numel:x}:{col:x}:{rows:x}:{rest:x}"


def checksum(region: torch.Tensor) -> str:
    """Checksum of any tensor's bytes in C order (convenience for tests and tools)."""
    sums = Checksums()
    sums.add("x", region.contiguous().view(-1).view(torch.uint8))
    return sums.result()["x"]


class Checksums:
    """Collects region checksums; on GPUs `result()` reads them all back at once."""

    def __init__(self) -> None:
        self._done: dict[str, str] = {}
        self._keys: list[str] = []
        self._device = DeviceSums()

    def add(self, key: str, region_bytes: torch.Tensor) -> None:
        """`region_bytes`: a contiguous uint8 tensor."""
        if region_bytes.device.type == "cpu":
            self._done[key] = _xxh3(region_bytes)
        else:
            self._keys.append(key)
            self._device.add(region_bytes)

    def add_xxh3(self, key: str, nbytes: int, digest: int) -> None:
        """CPU: a region of `nbytes` whose xxh3-64 the caller computed (`fused`)."""
        self._done[key] = _format_xxh3(nbytes, digest)

    def add_pieces(self, key: str, nbytes: int, pieces: Sequence[memoryview]) -> None:
        """CPU: a region whose bytes in C order are `pieces` (`nbytes` in all), one
        after another: xxh3 streams, so the value is the one of the bytes side by side."""
        if len(pieces) == 1:
            self._done[key] = _format_xxh3(nbytes, xxhash.xxh3_64_intdigest(pieces[0]))
            return
        state = xxhash.xxh3_64()
        for piece in pieces:
            state.update(piece)
        self._done[key] = _format_xxh3(nbytes, state.intdigest())

    def add_region(self, key: str, region: torch.Tensor) -> None:
        """A region of a tensor, by its bytes in C order, whatever its strides. On NVIDIA GPUs
        one kernel reads it where it lies (`checksum_kernel`); on CPU runs of `LONG_RUN_BYTES` or
        more are hashed where they lie (a delta refit's experts' halves: no copy of the region);
        otherwise it is copied contiguous first (for short runs one C copy beat hashing them one
        by one from Python, 3x on the 24 x 128-expert model's staging)."""
        described = checksum_kernel.describe(region)
        if described is not None:
            self._keys.append(key)
            self._device.add_in_place(described)
            return
        runs = long_runs(region, LONG_RUN_BYTES) if region.device.type == "cpu" else None
        if runs is not None:
            self.add_pieces(key, region.numel() * region.element_size(), [r.numpy().data for r in runs])
        else:
            self.add(key, region.contiguous().reshape(-1).view(torch.uint8))

    def add_copy(self, key: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` (same shape and dtype, no overlap) and add the checksum of the
        bytes written, by their C order. On NVIDIA GPUs both in one pass that reads `src` once
        (`checksum_kernel.describe_copy`), batched like `add_region`: the copy is enqueued by
        `flush` (or `result`), so read `dst` only after that. Elsewhere the copy, then
        `add_region` of `dst`."""
        described = checksum_kernel.describe_copy(dst, src)
        if described is not None:
            self._keys.append(key)
            self._device.add_in_place(described)
        else:
            dst.copy_(src)
            self.add_region(key, dst)

    def add_batch(self, keys: Sequence[str], batch: checksum_kernel.Batch) -> None:
        """The regions of a prepared `checksum_kernel.Batch` (keyed `keys`, in its order): the
        work of `add_region`/`add_copy` for regions whose places do not change, launched now."""
        self._keys.extend(keys)
        self._device.add_batch(batch)

    def flush(self) -> None:
        """Enqueue the GPU work of the regions added so far on the current stream (`add_region`
        batches; `result` flushes what is left)."""
        self._device.flush()

    def add_reduced(
        self, key: str, numel: int, cols: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor
    ) -> None:
        """A GPU region whose `reduce_region` outputs are enqueued already (a replayed CUDA graph)."""
        self._keys.append(key)
        self._device.add_reduced(numel, cols, rows, rest)

    def result(self) -> dict[str, str]:
        out = dict(self._done)
        values = self._device.values()
        out.update({k: _format_gpu(n, v) for k, n, v in zip(self._keys, self._device.numels, values)})
        return out
