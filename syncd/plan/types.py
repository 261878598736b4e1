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


@dataclass(frozen=True, slots=True)
class Relay:
    """What makes a bucket a relay (fan-out, `syncd.plan.fanout`): its `src`, a destination, sends
    on, unchanged, the bytes it received as bucket (`src`, `dst`, `index`) = `forwards`; `origin` is
    the source member that packed them, whose checksums every relayed copy is compared with."""

    origin: str
    forwards: tuple[str, str, int]


@dataclass(frozen=True)
class Bucket:
    """Units sent from `src` to `dst` in one message. `index` orders a link's buckets. A relay
    bucket (`relay` set) carries the units of the bucket it forwards: the same bytes, which land in
    the same destination regions, since only replicas of one layout relay to each other."""

    stage: int
    src: str
    dst: str
    index: int
    units: tuple[TransferUnit, ...]
    nbytes: int
    relay: Relay | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """What a `Relay.forwards` names this bucket by."""
        return (self.src, self.dst, self.index)

    @property
    def origin(self) -> str:
        """The source member that packed this bucket's bytes."""
        return self.src if self.relay is None else self.relay.origin


@dataclass(frozen=True)
class LinkSummary:
    stage: int
    src: str
    dst: str
    bytes: int
    buckets: int
    units: int
    relay: bool = False  # a destination forwarding what it received (fan-out)


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
    def source_bytes(self) -> int:
        """Bytes the sources (trainer ranks) send: with fan-out, one copy per layout."""
        return sum(b.nbytes for b in self.buckets if b.relay is None)

    @property
    def relay_bytes(self) -> int:
        """Bytes destinations forward to other destinations (fan-out)."""
        return sum(b.nbytes for b in self.buckets if b.relay is not None)

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
        relays = set()
        for b in self.buckets:
            row = acc.setdefault((b.stage, b.src, b.dst), [0, 0, 0])
            row[0] += b.nbytes
            row[1] += 1
            row[2] += len(b.units)
            if b.relay is not None:
                relays.add((b.stage, b.src, b.dst))
        return [
            LinkSummary(s, src, dst, nbytes, buckets, units, relay=(s, src, dst) in relays)
            for (s, src, dst), (nbytes, buckets, units) in sorted(acc.items())
        ]

    def stage_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for b in self.buckets:
            out[b.stage] += b.nbytes
        return dict(sorted(out.items()))
