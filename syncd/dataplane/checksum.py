"""Checksums of transferred regions, computed identically on sender and receiver.

Both ends of a group use the same device type, so each uses the fastest strong-enough check there:
- CPU: CRC-32 of the bytes (zlib; faster than a memcpy).
- GPU: one pass over the bytes. They are seen as an int8 matrix [rows, 1024] and multiplied by a
  fixed int8 weight matrix [1024, 8] on the tensor cores (`torch._int_mm`, exact int32 sums):
  eight differently weighted sums per row; the rows are then summed with their index as weight.
  Every byte counts with a weight that depends on its position, so corrupted, dropped and
  misplaced bytes change the result, and the cost is one read of the data. The sums stay on the device and are read back once per transfer, because a
  host read per region would stall the pipeline on every unit.
The text form starts with the algorithm, so mismatched algorithms can never compare equal.
"""

from __future__ import annotations

import zlib

import torch

_COLS = 1024
_MM_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _mm_weights(device: torch.device) -> torch.Tensor:
    """A fixed [1024, 8] int8 matrix of nonzero weights, the same on every machine."""
    w = _MM_WEIGHTS.get(device)
    if w is None:
        i = torch.arange(_COLS, dtype=torch.int64).unsqueeze(1)
        j = torch.arange(8, dtype=torch.int64).unsqueeze(0)
        w = (i * 131 + j * 71 + i * j * 17) % 251 - 125
        w = torch.where(w == 0, torch.ones_like(w), w).to(torch.int8).to(device)
        _MM_WEIGHTS[device] = w
    return w


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64 on `device`, cached (grown on demand) to save a kernel per region."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, 1 << 16) + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = w
    return w[:n]


def _gpu_sums(region_bytes: torch.Tensor) -> torch.Tensor:
    """Nine int64 sums of a contiguous uint8 tensor (see the module docstring)."""
    n = region_bytes.numel()
    dev = region_bytes.device
    rows = n // _COLS if n // _COLS > 16 else 0  # _int_mm needs more than 16 rows
    if rows:
        matrix = region_bytes[: rows * _COLS].view(torch.int8).view(rows, _COLS)
        per_row = torch._int_mm(matrix, _mm_weights(dev)).to(torch.int64)  # [rows, 8]
        head = (per_row * _weights(rows, dev).unsqueeze(1)).sum(0)
    else:
        head = torch.zeros(8, dtype=torch.int64, device=dev)
    rest = region_bytes[rows * _COLS :].to(torch.int64)
    tail = (rest * _weights(rest.numel(), dev)).sum().reshape(1)
    return torch.cat([head, tail])


def _format_gpu(numel: int, row: list[int]) -> str:
    return f"sums:{numel:x}:" + ":".join(f"{v & 0xFFFFFFFFFFFFFFFF:x}" for v in row)


def _crc(region_bytes: torch.Tensor) -> str:
    return f"crc32:{region_bytes.numel():x}:{zlib.crc32(region_bytes.numpy()):08x}"


def checksum(region: torch.Tensor) -> str:
    """Checksum of any tensor's bytes in C order (convenience for tests and tools)."""
    sums = Checksums()
    sums.add("x", region.contiguous().view(-1).view(torch.uint8))
    return sums.result()["x"]


def unit_key(canonical: str, start: tuple[int, ...], stop: tuple[int, ...]) -> str:
    """How checksums name a canonical region, on both sides and in syncd's comparison."""
    return canonical + "[" + ",".join(f"{a}:{b}" for a, b in zip(start, stop)) + "]"


class Checksums:
    """Collects region checksums; on GPUs `result()` reads them all back at once."""

    def __init__(self) -> None:
        self._done: dict[str, str] = {}
        self._keys: list[str] = []
        self._numels: list[int] = []
        self._sums: list[torch.Tensor] = []

    def add(self, key: str, region_bytes: torch.Tensor) -> None:
        """`region_bytes`: a contiguous uint8 tensor."""
        if region_bytes.device.type == "cpu":
            self._done[key] = _crc(region_bytes)
        else:
            self._keys.append(key)
            self._numels.append(region_bytes.numel())
            self._sums.append(_gpu_sums(region_bytes))

    def result(self) -> dict[str, str]:
        out = dict(self._done)
        if self._sums:
            rows = torch.stack(self._sums).cpu().tolist()
            out.update({k: _format_gpu(n, r) for k, n, r in zip(self._keys, self._numels, rows)})
        return out
