"""Checksums of transferred regions, computed identically on sender and receiver.

Both ends of a group use the same device type, so each uses the fastest strong-enough check there:
- CPU: CRC-32 of the bytes (zlib; faster than a memcpy).
- GPU: the region's 32-bit words seen as a [rows, 1024] matrix; index-weighted sums of its column
  sums and of its row sums (int64). Two bandwidth-bound reductions catch corrupted, dropped and
  misplaced words. The sums stay on the device and are read back once per transfer, because a
  host read per region would stall the pipeline on every unit.
The text form starts with the algorithm, so mismatched algorithms can never compare equal.
"""

from __future__ import annotations

import zlib

import torch

_COLS = 1024


def _gpu_sums(region_bytes: torch.Tensor) -> torch.Tensor:
    n = region_bytes.numel()
    words = region_bytes[: n - n % 4].view(torch.int32)
    tail = region_bytes[n - n % 4 :].to(torch.int64)
    full = words.numel() - words.numel() % _COLS
    matrix = words[:full].view(-1, _COLS)
    rest = words[full:].to(torch.int64)
    dev = region_bytes.device
    col = matrix.sum(dim=0, dtype=torch.int64)
    row = matrix.sum(dim=1, dtype=torch.int64)
    out = torch.stack([
        torch.tensor(n, dtype=torch.int64, device=dev),
        (col * torch.arange(1, _COLS + 1, device=dev)).sum(),
        (row * torch.arange(1, row.numel() + 1, device=dev)).sum(),
        (rest * torch.arange(1, rest.numel() + 1, device=dev)).sum() + (tail * torch.arange(1, tail.numel() + 1, device=dev)).sum(),
    ])
    return out


def _format_gpu(row: list[int]) -> str:
    return "sums:" + ":".join(f"{v & 0xFFFFFFFFFFFFFFFF:x}" for v in row)


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
        self._sums: list[torch.Tensor] = []

    def add(self, key: str, region_bytes: torch.Tensor) -> None:
        """`region_bytes`: a contiguous uint8 tensor."""
        if region_bytes.device.type == "cpu":
            self._done[key] = _crc(region_bytes)
        else:
            self._keys.append(key)
            self._sums.append(_gpu_sums(region_bytes))

    def result(self) -> dict[str, str]:
        out = dict(self._done)
        if self._sums:
            rows = torch.stack(self._sums).cpu().tolist()
            out.update({k: _format_gpu(r) for k, r in zip(self._keys, rows)})
        return out
