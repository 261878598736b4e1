"""The planner's inputs and outputs: plain frozen dataclasses, no I/O."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from syncd.layout import Box, Catalog
from syncd.vocabulary import Fp8Part


@dataclass(frozen=True)
class SourceMember:
    """A sending member (trainer rank) of pipeline stage `stage`."""

    member_id: str
    stage: int
    catalog: Catalog


@dataclass(frozen=True)
class DestMember:
    """A receiving member (generator worker). `by_layer`: it installs while it receives, so its
    buckets are cut at groups of whole layers (`syncd.plan.planner` says how)."""

    member_id: str
    catalog: Catalog
    by_layer: bool = False


@dataclass(frozen=True, slots=True)
class TransferUnit:
    """Region `canon` of canonical tensor `canonical`, read by the sender from `src_box` of its
    tensor `src_tensor` and written by the receiver into `dst_box` of `dst_tensor`. Both local boxes
    flatten (C order) to the same element sequence as `canon`.

    `dtype` is the destination's element type, which is what travels: `nbytes` counts it. When the
    sender holds the tensor in another type, `src_dtype` names it and the sender converts while
    packing (`syncd.layout.dtypes.conversion` says which pairs are allowed); None means no
    conversion.

    `quantized` (an `Fp8Part`: values or scales) marks a unit of a blockwise-FP8 destination
    (`syncd.plan.fp8_blocks`): the sender quantizes `block_box` (whole blocks of the canonical
    weight it holds, read from `src_box`) and sends the e4m3 values, or the scales, of `canon`."""

    canonical: str
    canon: Box
    dtype: str
    src_tensor: str
    src_box: Box
    dst_tensor: str
    dst_box: Box
    nbytes: int
    src_dtype: str | None = None
    quantized: Fp8Part | None = None
    block_box: Box | None = None


@dataclass(frozen=True)
class Bucket:
    """Units sent from `src` to `dst` in one message. `index` orders a link's buckets."""

    stage: int
    src: str
    dst: str
    index: int
    units: tuple[TransferUnit, ...]
    nbytes: int


@dataclass(frozen=True)
class LinkSummary:
    stage: int
    src: str
    dst: str
    bytes: int
    buckets: int
    units: int


@dataclass(frozen=True)
class Plan:
    """Every bucket of one refit, in a deterministic order: by stage, src, dst, index."""

    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    stage_members: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_units(self) -> int:
        return sum(len(b.units) for b in self.buckets)

    @cached_property
    def _by_member(self) -> dict[str, tuple[Bucket, ...]]:
        out: dict[str, list[Bucket]] = defaultdict(list)
        for b in self.buckets:
            out[b.src].append(b)
            out[b.dst].append(b)
        return {k: tuple(v) for k, v in out.items()}

    def for_member(self, member_id: str) -> tuple[Bucket, ...]:
        """The buckets `member_id` sends or receives, in plan order."""
        return self._by_member.get(member_id, ())

    def links(self) -> list[LinkSummary]:
        acc: dict[tuple[int, str, str], list[int]] = {}
        for b in self.buckets:
            row = acc.setdefault((b.stage, b.src, b.dst), [0, 0, 0])
            row[0] += b.nbytes
            row[1] += 1
            row[2] += len(b.units)
        return [LinkSummary(s, src, dst, *row) for (s, src, dst), row in sorted(acc.items())]

    def stage_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for b in self.buckets:
            out[b.stage] += b.nbytes
        return dict(sorted(out.items()))
