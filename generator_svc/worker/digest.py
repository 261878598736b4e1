"""A worker's digest of the version it serves, for `syncctl verify` (`syncd.daemon.digests`).

What is digested: staging, in staged mode, where the committed version's bytes stay after the
install (in vLLM's parameter format, after any dtype conversion or FP8 quantizing: the format the
senders checksummed). The regions are the units of the refit that brought the version (one
checksum per canonical region, keyed as the data plane keys them), so syncd's record of the
senders' checksums compares one to one.

Not digested: the engine's own kernel tensors. vLLM CPU repacks linear weights into oneDNN
handles and prepacks MoE experts after loading, so the bytes it computes with are no longer in
checkpoint format; the install copies staging into the parameters (one copy per parameter) right
before that post-processing. In inplace mode there is no staging: the digest is unavailable and
says so. Staging stops holding the served version as soon as a later refit (or a manual stage)
starts writing it; the digest then says that, until a version is committed again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from generator_svc.worker_protocol import WorkerDigest
from syncd.commands import checksum_key
from syncd.layout import Box
from syncd.member.dataplane.checksum import Checksums
from syncd.plan.types import Bucket


@dataclass(frozen=True)
class _Region:
    key: str
    tensor: str
    box: Box


class ServedRegions:
    """Which staging regions hold the served version. Thread-safe: the member agent's thread
    writes, the API server's digest request reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receiving: tuple[_Region, ...] = ()
        self._served: tuple[str, tuple[_Region, ...]] | None = None  # (version label, regions)
        self._why_not = "no version was committed by syncd yet"

    def receiving(self, refit_id: str, buckets: Sequence[Bucket], member_id: str) -> None:
        """A refit starts writing staging."""
        regions = tuple(
            _Region(checksum_key(u.canonical, u.canon), u.dst_tensor, u.dst_box)
            for b in buckets
            if b.dst == member_id
            for u in b.units
        )
        self.overwritten(f"refit {refit_id} wrote staging after the served version was installed")
        with self._lock:
            self._receiving = regions

    def overwritten(self, why: str) -> None:
        with self._lock:
            self._served, self._why_not, self._receiving = None, why, ()

    def applied(self, version: str) -> None:
        """The refit's version was installed and is served."""
        with self._lock:
            if self._receiving:
                self._served, self._receiving = (version, self._receiving), ()

    def digest(self, buffers: Mapping[str, torch.Tensor], member_id: str) -> WorkerDigest:
        """The checksums of staging by region key, when it holds the served version whole."""
        with self._lock:
            served, why_not = self._served, self._why_not
        if served is None:
            return WorkerDigest(member_id, version="", available=False, reason=why_not)
        version, regions = served
        sums = Checksums()
        for r in regions:
            sums.add_region(r.key, buffers[r.tensor][r.box.slices()])
        checksums = sums.result()
        with self._lock:  # a refit that began meanwhile may have written what was read
            if self._served is not served:
                return WorkerDigest(member_id, version="", available=False, reason=self._why_not)
        return WorkerDigest(member_id, version=version, available=True, reason="", checksums=checksums)
