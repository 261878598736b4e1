"""Checksums of transferred regions, computed identically on sender and receiver.

Both ends of a group use the same device type, so each uses the fastest strong-enough check there:
- CPU: CRC-32 of the bytes (zlib; faster than a memcpy).
- GPU: the region's 32-bit words seen as a [rows, 1024] matrix; index-weighted sums of its column
  sums and of its row sums. The two big reductions accumulate in wrapping int32 so the data is
  never copied to a wider type; they are bandwidth-bound and catch corrupted, dropped and
  misplaced words. The sums stay on the device and are read back once per transfer, because a
  host read per region would stall the pipeline on every unit.
The text form starts with the algorithm, so mismatched algorithms can never compare equal.
"""

from __future__ import annotations

import zlib

import torch

_COLS = 1024


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64 on `device`, cached (grown on demand) to save a kernel per region."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, _COLS, 1 << 16) + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = w
    return w[:n]


def _gpu_sums(region_bytes: torch.Tensor) -> torch.Tensor:
    n = region_bytes.numel()
    words = region_bytes[: n - n % 4].view(torch.int32)
    full = words.numel() - words.numel() % _COLS
    matrix = words[:full].view(-1, _COLS)
    col = matrix.sum(dim=0, dtype=torch.int32).to(torch.int64)
    row = matrix.sum(dim=1, dtype=torch.int32).to(torch.int64)
    rest = torch.cat([words[full:].to(torch.int64), region_bytes[n - n % 4 :].to(torch.int64)])
    dev = region_bytes.device
    return torch.stack([  # the size stays on the host: a host-to-device copy here would sync
        (col * _weights(col.numel(), dev)).sum(),
        (row * _weights(row.numel(), dev)).sum(),
        (rest * _weights(rest.numel(), dev)).sum(),
    ])


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
