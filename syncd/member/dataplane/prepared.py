"""Per-bucket work of the eager loops, prepared once per plan and reused by every later refit.

Why: at small buckets the loops are host-bound. Before this, each bucket cost the host, per unit,
the slicing of its source or destination region, two dtype views, the staging slice, a checksum
key string and three output allocations, before the one copy and the two reductions that do the
work: tens of microseconds per unit in Python, while a 64 MiB bucket crosses NVLink in 0.19 ms
(py-spy of the 2x H200 benchmark, 2026-11-23). A plan is fixed between refits (the member reuses
the decoded plan when syncd sends the same one, `syncd.api.convert`), and so are the tensors and the
staging buffers, so all of that is computed on the first refit and kept: what remains per bucket
is the copies (one `torch._foreach_copy_` call) and the reductions into outputs allocated once.

The values are the same as the unprepared path's: the same copies (`pack_into` and `unpack_from`
semantics, the cast included) and `Checksums.add` / `reduce_region` on the same bytes.

Lifecycle as `graphs.LoopGraphs`: one `PreparedLoop` per direction of a transport (kept with its
staging buffers); a bucket's work is keyed by the bucket object, its staging slice and the
addresses of the tensors it touches; `retain_used` keeps one plan's worth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane import checksum_kernel
from syncd.member.dataplane.checksum import Checksums, reduce_region, region_outputs
from syncd.member.dataplane.fused import FusedCopies
from syncd.member.dataplane.pack import Copies, copy_pairs
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction


class PreparedBucket:
    """One bucket's copies and checksum inputs in one staging slice."""

    def __init__(
        self,
        direction: Direction,
        bucket: Bucket,
        tensors: Mapping[str, torch.Tensor],
        flat: torch.Tensor,
        scratch: torch.Tensor | None = None,
        direct: bool = True,
    ) -> None:
        """`scratch`: for a receive on CPU, memory of the bucket's size where the landed check
        gathers the destination regions (`landed`). `direct` False: always copy between `flat`
        and the tensors (a receive read where a local sender packed it)."""
        self._copies = copy_pairs(direction, bucket, tensors, flat)
        self._regions_of(bucket, flat, _direct_bytes(direction, bucket, self._copies) if direct else None)
        self._direction, self._tensors, self._scratch = direction, tensors, scratch
        self._fused: FusedCopies | None = None  # made on first use
        # A receive's destination regions, where the landed check reads them.
        receiving = direction == Direction.RECV
        units = zip(self._regions, bucket.units) if receiving else ()
        self._landed = [(key, tensors[u.dst_tensor][u.dst_box.slices()]) for (key, _), u in units]
        self._landed_launch = _PreparedLaunch(self._landed)
        self._copy_made = False  # `_copy_launch`, made on first use
        self._copy_prepared: tuple[list[str], checksum_kernel.Batch] | None = None

    def _regions_of(self, bucket: Bucket, flat: torch.Tensor, direct: torch.Tensor | None) -> None:
        self.bucket = bucket  # held, so that the id in the cache key stays this bucket's
        self.flat = flat
        self.direct = direct
        self.wire = flat if direct is None else direct
        self._regions: list[tuple[str, torch.Tensor]] = []  # (checksum key, packed bytes)
        offset = 0
        for u in bucket.units:
            self._regions.append((checksum_key(u.canonical, u.canon), self.wire[offset : offset + u.nbytes]))
            offset += u.nbytes
        self._outputs: list[tuple[torch.Tensor, ...]] | None = (
            None  # GPU reduction outputs, made on first use
        )
        self._wire_launch = _PreparedLaunch(self._regions)

    def copy(self) -> None:
        """Pack (send) or unpack (recv) the bucket on the current stream (nothing to do when the
        bucket travels straight from or into its tensor)."""
        if self.direct is None:
            self._copies.run()

    def checksum(self, sums: Checksums) -> None:
        """Checksum every unit's packed bytes into `sums` (on GPUs: enqueue the reductions on the
        current stream into outputs owned by this bucket; they are read when `sums` folds)."""
        if self.flat.device.type == "cpu":
            for key, packed in self._regions:
                sums.add(key, packed)
            return
        if self._wire_launch.add_to(sums):
            return
        if self._outputs is None:
            self._outputs = [region_outputs(packed.numel(), packed.device) for _, packed in self._regions]
        for (key, packed), (cols, rows, rest) in zip(self._regions, self._outputs):
            reduce_region(packed, cols, rows, rest)
            sums.add_reduced(key, packed.numel(), cols, rows, rest)

    @property
    def fusable(self) -> bool:
        """Whether the copy can take the checksums of what it writes in the same pass
        (`copy_and_checksum`): on CPU, a bucket packed into (or unpacked from) staging; on NVIDIA
        GPUs, one whose every unit is a plain copy that `checksum_kernel` takes (no cast, no
        FP8). One sent from or received into its tensor as it is cannot."""
        if self.direct is not None or type(self) is not PreparedBucket:
            return False
        if self.flat.device.type == "cpu":
            return True
        return self._copy_launch() is not None

    def _copy_launch(self) -> tuple[list[str], checksum_kernel.Batch] | None:
        """On GPUs: the bucket's copies with their checksums as one prepared launch, made on
        first use; None where a unit is not a plain copy the kernel takes."""
        if self._copy_made:
            return self._copy_prepared
        self._copy_made = True
        if self._copies.computed or len(self._copies.dsts) != len(self._regions):
            return None
        keys = [key for key, _ in (self._landed if self._direction == Direction.RECV else self._regions)]
        described = [
            checksum_kernel.describe_copy(d, s) for d, s in zip(self._copies.dsts, self._copies.srcs)
        ]
        regions = [d for d in described if d is not None]
        if regions and len(regions) == len(described):
            self._copy_prepared = (keys, checksum_kernel.Batch(regions))
        return self._copy_prepared

    def copy_and_checksum(self, sums: Checksums) -> None:
        """`copy` with the checksums of what it wrote: a send's packed bytes, or a receive's
        units where they landed (the landed check). On CPU chunk by chunk from cache (`fused`);
        on GPUs one kernel per variant reads each unit once, writes it and sums the items it
        wrote (`checksum_kernel.describe_copy`), where a copy and then a checksum pass read the
        bucket twice (and three launches per bucket cost the host more than one)."""
        if self.flat.device.type != "cpu":
            prepared = self._copy_launch()
            assert prepared is not None  # `fusable` said so
            sums.add_batch(*prepared)
            return
        if self._fused is None:
            if self._direction == Direction.SEND:
                self._fused = FusedCopies.pack(self.bucket, self._tensors, self.flat)
            else:
                assert self._scratch is not None  # a receive on CPU has scratch (`PreparedLoop`)
                self._fused = FusedCopies.unpack(self.bucket, self._tensors, self.flat, self._scratch)
        self._fused.run(sums)

    def landed(self, sums: Checksums) -> None:
        """Checksum every unit of a received bucket where it landed into `sums`
        (`syncd.member.dataplane.landed.add_landed`, with the regions sliced once per plan): the
        GPU loops' check, and a CPU bucket that arrived straight into its tensor (`direct`),
        hashed where it is; CPU buckets through staging check in `copy_and_checksum`."""
        if self.direct is not None:  # arrived where it lands: its wire bytes are the landed ones
            if self._wire_launch.add_to(sums):
                return
            for key, packed in self._regions:
                sums.add(key, packed)
            return
        if self._landed_launch.add_to(sums):
            return
        for key, region in self._landed:
            sums.add_region(key, region)
        sums.flush()


class _PreparedLaunch:
    """GPU regions' checksums as one prepared launch (`checksum_kernel.Batch`: the regions
    described and their table uploaded once), made on first use. A prepared bucket's regions lie
    where they lay at the last refit (it is keyed by its tensors and staging), so the host's cost
    per refit is one launch per kernel variant: describing a bucket's regions and launching
    reductions region by region on every refit kept the host, not the memory, the checksums'
    limit (2x H200, 64 MiB buckets: the sender's GPU idle 42 of 57 ms)."""

    def __init__(self, regions: list[tuple[str, torch.Tensor]]) -> None:
        self._regions = regions
        self._made = False
        self._prepared: tuple[list[str], checksum_kernel.Batch] | None = None

    def add_to(self, sums: Checksums) -> bool:
        """Launch the checksums of the regions into `sums`; False (nothing done) where there is
        no region or one cannot take the kernel (not on a GPU, no Triton, an odd shape)."""
        if not self._made:
            self._made = True
            described = [(key, checksum_kernel.describe(region)) for key, region in self._regions]
            regions = [d for _, d in described if d is not None]
            if described and len(regions) == len(described):
                self._prepared = ([key for key, _ in described], checksum_kernel.Batch(regions))
        if self._prepared is None:
            return False
        sums.add_batch(*self._prepared)
        return True


def _direct_bytes(direction: Direction, bucket: Bucket, copies: Copies) -> torch.Tensor | None:
    """The bytes of a one-unit bucket whose region in the member's own tensor is one contiguous
    range, with no cast: those bytes are exactly what the bucket carries, so they can go on the
    wire as they are, without the copy into (or out of) staging. (A third of the bytes of the
    benchmark's plan at 64-512 MiB buckets; the copy competes with the transfer for memory
    bandwidth.) None otherwise."""
    if len(bucket.units) != 1 or copies.computed:
        return None
    dsts, srcs = copies.dsts, copies.srcs
    mine = srcs[0] if direction == Direction.SEND else dsts[0]
    if mine.dtype != dsts[0].dtype or mine.dtype != srcs[0].dtype or not mine.is_contiguous():
        return None
    return mine.reshape(-1).view(torch.uint8)


@runtime_checkable
class ReceiveSink(Protocol):
    """A receiver that takes each arrived bucket itself instead of naming tensors to unpack into
    (the generator's in-place install: the destinations exist only while their layer is open)."""

    device: torch.device

    def unpack(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Take the bucket's packed bytes (`flat`, valid only during the call)."""
        ...

    def position(self, bucket: Bucket) -> tuple:
        """Where the bucket's first byte lands, in the order the sink wants its buckets."""
        ...

    def landed(self) -> Mapping[str, str]:
        """Checksums (by unit key, `syncd.member.dataplane.landed`) of every unit's bytes where
        the sink wrote them, taken before anything transformed them; the loop compares them
        with the received ones after the last bucket."""
        ...


class SinkBucket(PreparedBucket):
    """A received bucket handed to a `ReceiveSink`; checksummed like any other bucket."""

    def __init__(self, bucket: Bucket, flat: torch.Tensor, sink: ReceiveSink) -> None:
        self._sink = sink
        self._regions_of(bucket, flat, None)

    def copy(self) -> None:
        self._sink.unpack(self.bucket, self.flat)


class PreparedLoop:
    """The prepared buckets of one loop (one direction of one transport)."""

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self._buckets: dict[tuple, PreparedBucket] = {}
        self._used: set[tuple] = set()
        self._scratch = torch.empty(0, dtype=torch.uint8)  # receives on CPU: `copy_and_checksum`

    def _scratch_for(self, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor | None:
        """The landed check's gathering memory (`fused`), shared by the loop's buckets: their
        unpacks run one after another, on the loop's thread."""
        if self.direction != Direction.RECV or flat.device.type != "cpu":
            return None
        if self._scratch.numel() < bucket.nbytes:  # buckets prepared before keep the old one alive
            self._scratch = torch.empty(bucket.nbytes, dtype=torch.uint8)
        return self._scratch[: bucket.nbytes]

    def buckets(
        self, ordered: Sequence[Bucket], tensors: Mapping[str, torch.Tensor], flats: Sequence[torch.Tensor]
    ) -> list[PreparedBucket]:
        """The prepared work of each bucket in its staging slice, preparing those not seen before."""
        return [self.bucket(bucket, tensors, flat) for bucket, flat in zip(ordered, flats)]

    def bucket(
        self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor, direct: bool = True
    ) -> PreparedBucket:
        """The prepared work of `bucket` in `flat` (`PreparedBucket`'s `direct`), prepared if new."""
        key = self._key(bucket, tensors, flat, direct)
        prepared = self._buckets.get(key)
        if prepared is None:
            scratch = self._scratch_for(bucket, flat)
            prepared = PreparedBucket(self.direction, bucket, tensors, flat, scratch, direct)
            self._buckets[key] = prepared
        self._used.add(key)
        return prepared

    def _key(
        self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor, direct: bool
    ) -> tuple:
        names = [u.src_tensor if self.direction == Direction.SEND else u.dst_tensor for u in bucket.units]
        return (
            id(bucket),
            flat.data_ptr(),
            flat.numel(),
            direct,
            tuple(tensors[n].data_ptr() for n in names),
        )

    def retain_used(self) -> None:
        """Forget the buckets the refit that just ended did not use (an older plan's)."""
        self._buckets = {k: b for k, b in self._buckets.items() if k in self._used}
        self._used = set()
