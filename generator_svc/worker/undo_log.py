"""The undo log of an in-place delta refit: before a delta overwrites part of a live tensor, the
old values are saved here, so that a refit that fails after its first write puts the previous
version back bit for bit (`rollback`).

A sparse unit saves its positions (flat, in the C order of its region) and their old values; a
dense unit saves its whole old region. The log's memory is what the delta changes (positions and
values), plus the old bytes of its dense units. Thread-safe: each PP stage's receive saves from its
own thread, and the rollback may come from another (an abort). After a rollback the log is closed:
a late writer's `save` raises `UndoClosed` instead of writing into the restored tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# The delta's own write (`scatter_flat`, flat C-order positions into a region that may not be
# contiguous) and its coordinates: the rollback writes back exactly where the delta wrote.
from syncd.member.dataplane.delta import scatter_flat, unravel_flat


class UndoClosed(RuntimeError):
    """The log was rolled back or discarded: nothing may be written under it any more."""


@dataclass
class _Saved:
    region: torch.Tensor  # a view of the live tensor the delta writes into
    index: torch.Tensor | None  # flat positions (C order of `region`); None: the whole region
    old: torch.Tensor  # the old values: at `index`, or the whole region (a copy)


class UndoLog:
    def __init__(self) -> None:
        self._saved: list[_Saved] = []
        self._lock = threading.Lock()
        self._closed = False
        self.rolled_back = False

    def save(self, region: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Keep the values of `region` that a delta is about to overwrite: those at `index` (flat
        positions, C order), or all of them (None: a dense unit)."""
        with self._lock:
            if self._closed:
                raise UndoClosed("the delta's undo log was rolled back; not writing more bytes")
            if index is None:
                self._saved.append(_Saved(region, None, region.clone()))
                return
            index = index.to(torch.int64)  # its own copy: the received message is reused
            self._saved.append(_Saved(region, index, _gather(region, index)))

    @property
    def nbytes(self) -> int:
        """Memory the log holds: old values and positions."""
        with self._lock:
            return sum(
                s.old.numel() * s.old.element_size()
                + (0 if s.index is None else s.index.numel() * s.index.element_size())
                for s in self._saved
            )

    def close(self) -> None:
        """Save nothing more (a writer still running fails on its next save)."""
        with self._lock:
            self._closed = True

    def rollback(self) -> tuple[int, int]:
        """Write every saved value back, newest first (so a position written twice gets its
        oldest value), and close the log. Returns (saves undone, how many of them had been
        overwritten with other bits: the writes that actually changed something)."""
        with self._lock:
            self._closed = self.rolled_back = True
            undone, overwritten = len(self._saved), 0
            for s in reversed(self._saved):
                if s.index is None:
                    overwritten += not _same_bits(s.region, s.old)
                    s.region.copy_(s.old)
                else:
                    overwritten += not _same_bits(_gather(s.region, s.index), s.old)
                    scatter_flat(s.region, s.index, s.old)
            self._saved.clear()
            return undone, overwritten

    def discard(self) -> None:
        """The refit committed: forget the old values (their memory is freed) and close the log."""
        with self._lock:
            self._closed = True
            self._saved.clear()


def _gather(region: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """region.flatten()[index], without copying a region that is not contiguous."""
    if region.is_contiguous():
        return region.view(-1).index_select(0, index)
    return region[unravel_flat(index, tuple(region.shape))]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
