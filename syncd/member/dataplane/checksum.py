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
  was no faster inside a refit; see bench/README.md.)
The text form starts with the algorithm, so mismatched algorithms can never compare equal.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

_COLS = 1024
_ROW_BYTES = 4 * _COLS


def _xxh3(region_bytes: torch.Tensor) -> str:
    return f"xxh3:{region_bytes.numel():x}:{xxhash.xxh3_64_intdigest(region_bytes.numpy().data):016x}"


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
    folds them for all regions together."""

    def __init__(self) -> None:
        self.numels: list[int] = []
        self._cols: list[torch.Tensor] = []  # [1024] int32 per region
        self._rows: list[torch.Tensor] = []  # [rows] int32 per region
        self._rests: list[torch.Tensor] = []  # the < 4 KiB that is not a full row, raw bytes

    def add(self, region_bytes: torch.Tensor) -> None:
        n = region_bytes.numel()
        cols, rows, rest = region_outputs(n, region_bytes.device)
        reduce_region(region_bytes, cols, rows, rest)
        self.add_reduced(n, cols, rows, rest)

    def add_reduced(self, numel: int, cols: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor) -> None:
        """A region of `numel` bytes whose `reduce_region` outputs are already enqueued (by
        `add`, or by a replayed CUDA graph that wrote them)."""
        self.numels.append(numel)
        self._cols.append(cols)
        self._rows.append(rows)
        self._rests.append(rest)

    def _weighted_row_sums(self, device: torch.device) -> torch.Tensor:
        """Per region k with rows r_k[0..n_k): sum_j (j + 1) * r_k[j], for all regions at once.
        With g the global row number (1-based) and s_k the rows before region k, (j + 1) = g - s_k,
        so the sum is G_k - s_k * R_k with G, R segment sums of g * r and r: one cumulative sum of
        both, read at the region boundaries. (A scatter-add of millions of rows costs a millisecond
        more, and the fold runs after the last bucket, on the refit's critical path.)"""
        counts = np.array([r.numel() for r in self._rows], dtype=np.int64)
        total = int(counts.sum())
        if not total:
            return torch.zeros(len(counts), dtype=torch.int64, device=device)
        bounds = np.cumsum(np.concatenate([[0], counts]))  # [starts..., last end]
        rows = torch.cat(self._rows).to(torch.int64)
        # One flat scan of [g * r, r] (a 1-D scan; a scan along rows of a 2-row matrix runs on two
        # thread blocks and takes milliseconds), read at both halves' region boundaries.
        flat = torch.cat([rows * _positions(total, device), rows])
        cum = torch.nn.functional.pad(torch.cumsum(flat, dim=0), (1, 0))  # cum[i] = sum of the first i
        at = cum[torch.from_numpy(np.concatenate([bounds, bounds + total])).to(device)].view(2, -1)
        seg = at[:, 1:] - at[:, :-1]
        return seg[0] - at.new_tensor(bounds[:-1]) * seg[1]

    def values(self) -> list[tuple[int, int, int]]:
        """(weighted column sums, weighted row sums, weighted rest) per region, in `add` order."""
        if not self.numels:
            return []
        device = self._cols[0].device
        cols = torch.stack(self._cols).to(torch.int64)
        col_sums = (cols * _positions(_COLS, device)).sum(dim=1)
        row_sums = self._weighted_row_sums(device)
        rest_bytes = (
            torch.cat(self._rests).cpu().numpy()
            if any(r.numel() for r in self._rests)
            else np.zeros(0, np.uint8)
        )
        col_list, row_list = torch.stack([col_sums, row_sums]).tolist()  # one read-back
        out, offset = [], 0
        for col, row, rest in zip(col_list, row_list, self._rests):
            if not rest.numel():  # the common case; numpy calls per region add up to milliseconds
                out.append((col, row, 0))
                continue
            tail = rest_bytes[offset : offset + rest.numel()]
            offset += rest.numel()
            words = tail[: tail.size - tail.size % 4].view("<i4")
            out.append(
                (
                    col,
                    row,
                    _weighted(
                        np.concatenate([words.astype(np.int64), tail[words.size * 4 :].astype(np.int64)])
                    ),
                )
            )
        return out


def _format_gpu(numel: int, row: tuple[int, int, int]) -> str:
    return f"sums:{numel:x}:" + ":".join(f"{v & 0xFFFFFFFFFFFFFFFF:x}" for v in row)


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

    def add_region(self, key: str, region: torch.Tensor) -> None:
        """A region of a tensor, by its bytes in C order, whatever its strides (copied contiguous
        first when it is not: one C copy beat hashing its contiguous runs one by one from Python,
        3x on the 24 x 128-expert model's staging)."""
        self.add(key, region.contiguous().reshape(-1).view(torch.uint8))

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
