"""Delta refits on the data plane: a link moves only the elements that changed since the version
its receiver holds (syncd names that version, the base, and the links that go as deltas).

The sender (a trainer rank) keeps a `Mirror`: the bytes it last sent, per local tensor and
destination dtype, after the conversion (a delta is taken in the generator's dtype, bit for bit).
Per delta link, in the plan's order:

1. Group by group of buckets (3.), the sender compares every unit's new values with its mirror
   (once per tensor per refit: links that move the same region share the result, `Diffs`) and
   sends the group's header: per unit, how many elements changed and whether the unit goes dense.
   A tensor whose sample of 1024 elements is mostly changed goes dense without the exact
   comparison (a step that changes everything is seen in a fraction of it).
2. A unit whose (index, value) pairs would cost as much as its dense bytes goes dense. A bucket
   whose encoding would not save `max_fraction` of its bytes goes dense whole, through the
   executor's own pipelined loop (`send_buckets` / `recv_buckets`), exactly as a full refit
   sends it. The mirror takes what was sent after the transfer (`Diffs.commit`: the changed
   positions of delta units, the whole regions of dense ones, from the sender's tensors), off the
   refit's path: a member's agent commits after it reported the transfer, still holding the
   trainer's weights, so the trainer's next optimizer step waits for the copy
   (`syncd.member.agent`). A step that changes nearly everything so costs a full refit on the
   refit's path, plus one copy of the weights into the mirror beside it.
3. The link goes in groups of buckets (`_groups`): each group's header, then the encodings of its
   other buckets, one piece: per unit, int32 positions (C order
   of the unit's region, ascending) and their values, or the unit's dense bytes; each part 8-byte
   aligned. The receiver sizes the piece from the header, forwards it on (a relay) as it arrived
   and applies it, so comparing, the wire, every hop of a chain and applying overlap group by
   group (one message for the link would cross each hop whole before the next hop began). Gloo
   sends a message only once its receive is posted, so a receiver takes the groups on a thread of
   its own (`_Taker`) while it applies the ones before, with the next header posted behind each
   piece. A link that goes dense whole sends its first header only (`_dense_whole`).

Verification covers whole regions, not the delta: the sender checksums each unit's full new values
and the receiver its full destination region after applying the delta, under the same keys as a
full refit (`checksum_key`), so syncd's comparison is the same and a receiver whose base is not the
sender's mirror (a restart, a torn refit, a flipped bit) fails it and the refit aborts.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from syncd.commands import DeltaLinks, checksum_key
from syncd.layout import Box
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.executor import TransferAborted, TransferStats, recv_buckets, send_buckets
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.transport import Handle, TransferError, Transport
from syncd.plan.types import Bucket, TransferUnit
from syncd.weight_version import WeightVersion

_INDEX = torch.int32  # positions within one unit: units are cut at bucket size, far below 2**31 elements
_ALIGN = 8  # every part of a delta message starts 8-byte aligned, so it can be viewed in its dtype
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare bit patterns (NaN == NaN)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _sparse_bytes(changed: int, itemsize: int) -> int:
    return _aligned(changed * _INDEX.itemsize) + _aligned(changed * itemsize)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_BITS[x.element_size()])


class Mirror:
    """What this sender last sent: one tensor per (local tensor, destination dtype), the local
    tensor's shape. `version` is the weight version of the last transfer that finished (None
    before the first, or while one runs). Only what that transfer sent holds that version: the
    tensors it sent whole to some receiver (`whole`), and the regions it sent (`held`); another
    plan may cut other regions, or have another sender send some."""

    def __init__(self) -> None:
        self.version: WeightVersion | None = None
        self.whole: frozenset[tuple[str, str]] = frozenset()  # (local tensor, dtype)
        self.held: frozenset[tuple] = frozenset()  # `_key`s of regions
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}
        self._samples: dict[tuple[str, str], torch.Tensor] = {}  # `_sample` views of `_tensors`

    def holds(self, u: TransferUnit) -> bool:
        return (u.src_tensor, u.dtype) in self.whole or _key(u) in self.held

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tensor(self, name: str, dtype: str, source: torch.Tensor) -> torch.Tensor:
        """The mirror of local tensor `name` (`source`, the sender's) in `dtype`."""
        t = self._tensors.get((name, dtype))
        if t is None or t.shape != source.shape or t.device != source.device:
            t = self._tensors[(name, dtype)] = torch.zeros(
                source.shape, dtype=torch_dtype(dtype), device=source.device
            )
            self._samples.pop((name, dtype), None)
        return t

    def sample(self, name: str, dtype: str, source: torch.Tensor) -> torch.Tensor:
        """`_sample` of `tensor(name, dtype, source)`: a view, kept (it sees every commit)."""
        t = self.tensor(name, dtype, source)
        view = self._samples.get((name, dtype))
        if view is None:
            view = self._samples[(name, dtype)] = _sample(t)
        return view

    def region(self, unit: TransferUnit, source: torch.Tensor) -> torch.Tensor:
        """The mirror of unit's source region (`source` is the sender's whole local tensor)."""
        return self.tensor(unit.src_tensor, unit.dtype, source)[unit.src_box.slices()]


@dataclass
class Change:
    """One region's difference from the mirror: `changed` elements differ; `index` and `values`
    are set when the unit goes as a delta."""

    changed: int
    numel: int
    index: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        return self.index is not None


@dataclass
class Diffs:
    """One refit's comparisons on one sender, shared by its stages and links. The mirror keeps the
    base until `commit`: links cut the same tensor into different regions, and each must be
    compared with the base, not with what another link already wrote."""

    mirror: Mirror
    lock: threading.Lock = field(default_factory=threading.Lock)
    changes: dict[tuple, tuple[TransferUnit, Change]] = field(default_factory=dict)
    absorbed: dict[tuple, TransferUnit] = field(default_factory=dict)  # regions sent on full links
    sent: dict[tuple[str, str, str], set[tuple]] = field(default_factory=dict)  # (dst, tensor, dtype) -> keys
    # (tensor, dtype) -> the flat positions where it changed, or None when most of it did
    positions: dict[tuple[str, str], torch.Tensor | None] = field(default_factory=dict)
    sampled: set[tuple[str, str]] = field(default_factory=set)  # (tensor, dtype): its sample said "compare"

    def of(self, u: TransferUnit, tensors: Mapping[str, torch.Tensor], dst: str) -> Change:
        """The unit's change from the base; all of it (dense) where the mirror does not hold the
        base of this region."""
        if u.quantized:  # FP8 units are computed from whole blocks, not copied: always dense
            return Change(u.canon.numel, u.canon.numel)
        key = _key(u)
        with self.lock:
            self.sent.setdefault((dst, u.src_tensor, u.dtype), set()).add(key)
            if key not in self.changes:
                positions = self._positions(u, tensors) if self.mirror.holds(u) else None
                change = (
                    Change(u.canon.numel, u.canon.numel)
                    if positions is None
                    else _unit_change(u, tensors[u.src_tensor], positions)
                )
                self.changes[key] = (u, change)
            return self.changes[key][1]

    def presample(self, units: Sequence[TransferUnit], tensors: Mapping[str, torch.Tensor]) -> None:
        """Before a link's comparisons, the samples of all its tensors at once
        (`_samples_mostly_changed`): the mostly changed ones go dense without their exact
        comparison. One tensor at a time costs ~0.1 ms of Python per tensor, and every receiver
        waits for every sender's header (its comparisons) before any dense bucket moves."""
        with self.lock:
            todo: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
            for u in units:
                key = (u.src_tensor, u.dtype)
                if u.quantized or key in todo or key in self.positions or key in self.sampled:
                    continue
                source = tensors[u.src_tensor]
                # Only tensors the mirror holds whole (see `_positions`), and big enough to sample.
                if key in self.mirror.whole and source.numel() > _SAMPLED_ABOVE:
                    todo[key] = (_sample(source), self.mirror.sample(u.src_tensor, u.dtype, source))
            for key, mostly in zip(todo, _samples_mostly_changed(list(todo.values()))):
                if mostly:
                    self.positions[key] = None
                else:
                    self.sampled.add(key)

    def dense_without_comparing(self, u: TransferUnit) -> bool:
        """Whether `of(u)` is all of `u`, known without an exact comparison: FP8, a region the mirror
        does not hold, a tensor found mostly changed by its sample (`presample`) or whose unit
        went dense already. The caller holds `lock`."""
        if u.quantized is not None or not self.mirror.holds(u):
            return True
        known = self.changes.get(_key(u))
        if known is not None:
            return not known[1].sparse
        key = (u.src_tensor, u.dtype)
        return key in self.positions and self.positions[key] is None

    def assume_dense(self, units: Iterable[TransferUnit], dst: str) -> None:
        """`of(u)` is all of `u`, counted as all changed, for each of `units` not compared yet: they
        go dense whatever an exact comparison would find (`_dense_whole`); the mirror takes them
        whole on `commit`."""
        with self.lock:
            for u in units:
                if u.quantized:  # as in `of` and `absorb`: FP8 units never enter the mirror
                    continue
                key = _key(u)
                self.sent.setdefault((dst, u.src_tensor, u.dtype), set()).add(key)
                if key not in self.changes:
                    self.changes[key] = (u, Change(u.canon.numel, u.canon.numel))

    def known_cheaply(self, u: TransferUnit, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether `of(u)` needs no exact comparison of a big tensor: FP8, a region the mirror does
        not hold, a tensor compared already or found mostly changed by its sample (`presample`), or a
        small one."""
        return (
            u.quantized is not None
            or not self.mirror.holds(u)
            or (u.src_tensor, u.dtype) in self.positions
            or tensors[u.src_tensor].numel() <= _SAMPLED_ABOVE
        )

    def _positions(self, u: TransferUnit, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Where the unit's local tensor changed: compared once per refit, whole (its units are
        regions of it, often not contiguous ones)."""
        key = (u.src_tensor, u.dtype)
        if key not in self.positions:
            source = tensors[u.src_tensor]
            # Where the mirror holds only some regions (another sender sent the rest last time), the
            # rest differs from it everywhere: "mostly changed" would say nothing of the held ones.
            old, whole = self.mirror.tensor(u.src_tensor, u.dtype, source), key in self.mirror.whole
            self.positions[key] = (
                None
                if whole and key not in self.sampled and _sample_mostly_changed(source, old)
                else _changed_positions(source, old, whole)
            )
        return self.positions[key]

    def absorb(self, u: TransferUnit, dst: str) -> None:
        """A unit sent dense on a full link: `commit` copies its new values into the mirror."""
        if u.quantized:
            return
        with self.lock:
            self.sent.setdefault((dst, u.src_tensor, u.dtype), set()).add(_key(u))
            self.absorbed[_key(u)] = u

    def commit(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The transfer succeeded: the mirror takes what it sent, the changed positions of delta
        units and the whole regions of dense ones, from `tensors`, which must still hold what was
        sent (the caller holds them still until this returns: the trainer's optimizer step waits).
        Until it returns the mirror is between versions (its `version` None, which the caller
        sets after it)."""
        dense = dict(self.absorbed)
        for key, (u, change) in self.changes.items():
            if not change.sparse:
                dense[key] = u
            elif change.changed and key not in dense:
                assert change.index is not None and change.values is not None  # sparse
                source = tensors[u.src_tensor]
                mirror = self.mirror.tensor(u.src_tensor, u.dtype, source)
                _scatter_box(mirror, u.src_box, mirror[u.src_box.slices()], change.index, change.values)
        for u in dense.values():  # one copy, converting as the packing copy does
            self.mirror.region(u, tensors[u.src_tensor]).copy_(tensors[u.src_tensor][u.src_box.slices()])
        self.mirror.held = frozenset(self.changes) | frozenset(self.absorbed)
        # A receiver's regions of one tensor are disjoint: if they add up to the tensor, it went whole.
        self.mirror.whole = frozenset(
            (name, dtype)
            for (_, name, dtype), keys in self.sent.items()
            if sum(k[1].numel for k in keys) == tensors[name].numel()
        )
        self.changes.clear()
        self.absorbed.clear()
        self.sent.clear()
        self.positions.clear()
        self.sampled.clear()


def _key(u: TransferUnit) -> tuple:
    """A sender's region as a mirror holds it."""
    return (u.src_tensor, u.src_box, u.dtype)


def _new_values(u: TransferUnit, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The unit's new values in its (destination) dtype, the region's shape: in C order exactly
    the bytes a full refit packs (`.to()` rounds as the packing copy does). Without a conversion,
    a view of the sender's tensor (not copied: checksummed where it lies)."""
    return tensors[u.src_tensor][u.src_box.slices()].to(torch_dtype(u.dtype))


# Above this fraction of changed elements (8-byte words on an accelerator), a tensor's units all
# go dense: listing the positions would cost more than sending the bytes (a delta element costs
# 4 + itemsize bytes).
_MOSTLY_CHANGED = 0.5
# A delta link travels in groups of buckets of at most this many (dense) bytes, a header and a piece
# each: small enough that the comparison, the wire, each hop of a chain and the receivers' apply
# overlap, large enough that a hop is not one wake-up per bucket (2.5 % changed: ~1.2 MB pieces).
_GROUP_BYTES = 16 << 20
_TRAILER = 8  # a piece ends with its byte count (int64), a header with its code count: `_Incoming`
# Added to a link's first header's trailer when every bucket of the link goes dense: the sender sends
# no other header for the link (`_dense_whole`), its receiver takes no other.
_REST_DENSE = 1 << 40
_FEW_RUNS = 64  # `_unit_change` takes a unit's changes run by run up to this many runs
_CHUNK = 1 << 18  # elements `_changed_positions` compares at a time on CPU (its mask stays in cache)


# Elements `_sample_mostly_changed` compares per tensor (its estimate's standard error is 0.016 at
# half changed); a tensor near the line costs about the same bytes either way.
_SAMPLE = 1024
# Taken in runs of adjacent elements (32 bfloat16 elements are one cache line): a link's samples
# cost memory latency, one line per run, not one per element (3 ms per trainer rank of the
# benchmark's model when they were evenly spaced elements, before its header could go).
_SAMPLE_RUN = 32
# Smaller tensors are only compared exactly (at 8192 elements that costs 3 samples, 90 us here).
_SAMPLED_ABOVE = 4 * _SAMPLE


def _sample_runs(numel: int) -> tuple[int, int]:
    """Where a tensor of `numel` (> `_SAMPLED_ABOVE`) elements is sampled: `_SAMPLE // _SAMPLE_RUN`
    runs of `_SAMPLE_RUN` flat positions, the r-th from `first + r * step`."""
    step = numel // (_SAMPLE // _SAMPLE_RUN)
    return (step - _SAMPLE_RUN) // 2, step


def _sample(t: torch.Tensor) -> torch.Tensor:
    """`t`'s sampled elements (`_sample_runs`), a [runs, `_SAMPLE_RUN`] view of `t` in C order."""
    flat = t if t.is_contiguous() else t.reshape(-1)  # as_strided addresses the storage
    first, step = _sample_runs(flat.numel())
    return flat.as_strided((_SAMPLE // _SAMPLE_RUN, _SAMPLE_RUN), (step, 1), flat.storage_offset() + first)


def _sample_mostly_changed(source: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether more than `_MOSTLY_CHANGED` of `_SAMPLE` elements of `source` (evenly spaced runs of
    adjacent ones, `_sample_runs`), in the
    mirror's dtype, differ from the mirror `old`: a step that changes most of a tensor is seen here
    in a fraction of the exact comparison. A word differs where any of its elements does, so a
    tensor found mostly changed here would be by `_changed_positions` too, but for sampling error,
    which costs bytes (its units go dense), never exactness."""
    return source.numel() > _SAMPLED_ABOVE and _samples_mostly_changed([(_sample(source), _sample(old))])[0]


def _samples_mostly_changed(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """`_sample_mostly_changed` of each pair of samples (`_sample` of a source tensor of more than
    `_SAMPLED_ABOVE` elements, of its mirror), in a few operations per mirror dtype: the samples
    stacked, compared at once."""
    out = [False] * len(pairs)
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, (_, old) in enumerate(pairs):
        by_dtype[old.dtype].append(i)
    for dtype, which in by_dtype.items():
        new = torch.stack([pairs[i][0] for i in which]).to(dtype)
        old = torch.stack([pairs[i][1] for i in which])
        differs = torch.ne(_bits(new), _bits(old)).sum(dim=(1, 2))
        for i, mostly in zip(which, (differs > _MOSTLY_CHANGED * _SAMPLE).tolist()):
            out[i] = mostly
    return out


def _changed_positions(source: torch.Tensor, old: torch.Tensor, give_up: bool) -> torch.Tensor | None:
    """Ascending flat positions where `source`, in the mirror's dtype, differs bitwise from the
    mirror `old`; None when most of its elements do and `give_up` (found while comparing, so a
    mostly changed tensor stops early and never lists its positions)."""
    new = source.to(old.dtype)
    if new.device.type != "cpu":
        return _changed_positions_on_device(new, old, give_up)
    # On CPU, numpy's comparison and flatnonzero, a cache-sized chunk at a time: a third of the time
    # of torch's (whose nonzero is slow on large masks), one pass over both tensors.
    a, b = _bits(new.reshape(-1)).numpy(), _bits(old.reshape(-1)).numpy()
    limit = _MOSTLY_CHANGED * a.size if give_up else math.inf
    parts, found = [], 0
    for start in range(0, a.size, _CHUNK):
        part = np.flatnonzero(a[start : start + _CHUNK] != b[start : start + _CHUNK])
        found += part.size
        if found > limit:
            return None
        parts.append(part + start if start else part)
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])


def _changed_positions_on_device(new: torch.Tensor, old: torch.Tensor, give_up: bool) -> torch.Tensor | None:
    """`_changed_positions` on an accelerator: compared 8 bytes at a time where the bytes allow it
    (a quarter of the comparisons for bfloat16), then element by element within changed words."""
    if new.is_contiguous() and (new.numel() * new.element_size()) % 8 == 0:
        words = new.view(-1).view(torch.int64) != old.view(-1).view(torch.int64)
        changed = int(torch.count_nonzero(words))
        if give_up and changed > _MOSTLY_CHANGED * words.numel():
            return None
        per = 8 // new.element_size()
        candidates = (words.nonzero().squeeze(1)[:, None] * per + torch.arange(per, device=new.device)).view(
            -1
        )
        flat_new, flat_old = _bits(new.view(-1)), _bits(old.view(-1))
        return candidates[flat_new[candidates] != flat_old[candidates]]
    differs = (_bits(new) != _bits(old)).view(-1)
    if give_up and int(torch.count_nonzero(differs)) > _MOSTLY_CHANGED * differs.numel():
        return None
    return differs.nonzero().squeeze(1)


def _box_runs(shape: tuple[int, ...], box: Box) -> tuple[torch.Tensor, int]:
    """A box of a C-order tensor as contiguous runs of flat positions: their starts, in the box's
    own C order, and their common length. The dims after the last partial one are whole, so
    each run is that dim's range times the whole dims after it."""
    partial = max((d for d in range(len(shape)) if (box.start[d], box.stop[d]) != (0, shape[d])), default=-1)
    if partial < 0:
        return torch.zeros(1, dtype=torch.int64), math.prod(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    starts = torch.tensor([box.start[partial] * strides[partial]], dtype=torch.int64)
    for d in reversed(range(partial)):  # outer dims: every combination of their indices, in C order
        offsets = torch.arange(box.start[d], box.stop[d], dtype=torch.int64) * strides[d]
        starts = (offsets[:, None] + starts[None, :]).reshape(-1)
    return starts, (box.stop[partial] - box.start[partial]) * strides[partial]


def _unit_change(u: TransferUnit, source: torch.Tensor, positions: torch.Tensor) -> Change:
    """The unit's share of its tensor's changed `positions` (ascending): counted per contiguous
    run of the unit's box by binary search, so a unit costs its runs, not the tensor's changes;
    where it goes as a delta, their positions within the box (C order) and new values."""
    starts, run = _box_runs(tuple(source.shape), u.src_box)
    first = torch.searchsorted(positions, starts)
    counts = torch.searchsorted(positions, starts + run) - first
    change = Change(int(counts.sum()), u.canon.numel)
    if _sparse_bytes(change.changed, u.nbytes // u.canon.numel) >= u.nbytes:
        return change
    if len(starts) <= _FEW_RUNS:  # a whole tensor, or experts' halves: each run's changes are a slice
        lows, ns, shifts = (
            first.tolist(),
            counts.tolist(),
            (starts - torch.arange(len(starts)) * run).tolist(),
        )
        slices = [positions[lo : lo + n] for lo, n in zip(lows, ns)]
        chosen = torch.cat(slices) if len(slices) > 1 else slices[0]
        index = [part - shift for part, shift in zip(slices, shifts)]
        change.index = (torch.cat(index) if len(index) > 1 else index[0]).to(_INDEX)
        change.values = source.reshape(-1).index_select(0, chosen).to(torch_dtype(u.dtype))
    else:
        which = torch.repeat_interleave(torch.arange(len(starts)), counts)  # the run of each change
        rank = torch.arange(change.changed) - (torch.cumsum(counts, 0) - counts)[which]
        chosen = positions[first[which] + rank]
        change.index = (chosen - starts[which] + which * run).to(_INDEX)
        change.values = source.view(-1)[chosen].to(torch_dtype(u.dtype))
    return change


def _header_code(change: Change) -> int:
    """How a unit travels, in the link's header: k >= 0 for k (index, value) pairs, -1 - k for the
    dense bytes of a unit of which k elements changed."""
    return change.changed if change.sparse else -1 - change.changed


def _unit_bytes(code: int, u: TransferUnit) -> int:
    itemsize = u.nbytes // u.canon.numel
    return _sparse_bytes(code, itemsize) if code >= 0 else _aligned(u.nbytes)


def _dense_bucket(codes: Sequence[int], bucket: Bucket, max_fraction: float) -> bool:
    """A bucket goes dense whole when its delta would not save `max_fraction` of its bytes, or
    when it holds blockwise-FP8 units (the executor's packing quantizes them)."""
    if any(u.quantized for u in bucket.units):
        return True
    delta = sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units))
    return all(c < 0 for c in codes) or delta > max_fraction * bucket.nbytes


@dataclass
class DeltaStats(TransferStats):
    """A member's transfer with delta links: bytes actually moved; over its delta links, the units'
    elements and how many of them changed."""

    elements: int = 0
    changed: int = 0
    touched: set[str] = field(default_factory=set)  # receiver: its tensors that took new values


def _links(buckets: Sequence[Bucket], peer: str) -> dict[str, list[Bucket]]:
    out: dict[str, list[Bucket]] = defaultdict(list)
    for b in sorted(buckets, key=lambda b: (getattr(b, peer), b.index)):
        out[getattr(b, peer)].append(b)
    return out


def _add(total: DeltaStats, part: TransferStats) -> None:
    total.bytes += part.bytes
    total.buckets += part.buckets
    total.checksums.update(part.checksums)


def send_with_deltas(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    links: DeltaLinks,
    diffs: Diffs,
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
) -> DeltaStats:
    """`send_buckets` for a sender that keeps a mirror (`diffs`, this refit's comparisons with it):
    full links go through it (the mirror takes their values), the links to `links.dsts` as
    described in the module docstring. Links go one after another in destination order (what the
    receivers' source order expects). The collector stays paused throughout, as in the loops:
    the comparisons and headers between them are on the refit's path too."""
    stats, start = DeltaStats(), time.perf_counter()
    with options.gc_paused():
        for dst, link in _links(buckets, "dst").items():
            _check(cancel)
            if dst not in links.dsts:
                _add(
                    stats, send_buckets(link, tensors, transport, ranks, options, cancel=cancel, cache=cache)
                )
                for b in link:
                    for u in b.units:
                        diffs.absorb(u, dst)
                continue
            _send_link(
                dst,
                link,
                tensors,
                transport,
                ranks[dst],
                links.max_fraction,
                diffs,
                stats,
                options,
                cancel,
                cache,
            )
    stats.seconds = time.perf_counter() - start
    return stats


def _send_link(
    dst: str,
    link: list[Bucket],
    tensors,
    transport: Transport,
    peer: int,
    max_fraction: float,
    diffs: Diffs,
    stats: DeltaStats,
    options: LoopOptions,
    cancel: threading.Event | None,
    cache: LoopCache | None,
) -> None:
    """Group by group (`_groups`), in link order, the group's header (`_header_code` per unit),
    then the encodings (`_encode`) of its buckets that go as deltas, one piece: comparing group
    k + 1 overlaps the wire (and every relay and receiver down the chain) taking group k. Then
    the dense buckets. A link that goes dense whole (`_dense_whole`) sends its first header only."""
    dense: list[Bucket] = []
    sent: list[tuple[Handle, torch.Tensor]] = []  # with their buffers, alive until sent
    whole = _dense_whole(link, tensors, diffs, dst, max_fraction)
    for i, group in enumerate(_groups(link)):
        _check(cancel)
        if whole and i > 0:  # no header: all dense, counted as all changed (as its receiver does)
            numel = sum(u.canon.numel for b in group for u in b.units)
            stats.elements, stats.changed = stats.elements + numel, stats.changed + numel
            dense += group
            continue
        changes = [[diffs.of(u, tensors, dst) for u in b.units] for b in group]
        codes = [[_header_code(c) for c in cs] for cs in changes]
        flat_codes = [c for cs in codes for c in cs]
        trailer = len(flat_codes) + (_REST_DENSE if whole else 0)  # `_Incoming`
        header = torch.tensor([*flat_codes, trailer], dtype=torch.int64)
        sent.append((transport.isend(header, peer), header))
        parts = []
        for bucket, cs, bucket_codes in zip(group, changes, codes):
            stats.elements += sum(c.numel for c in cs)
            stats.changed += sum(c.changed for c in cs)
            if _dense_bucket(bucket_codes, bucket, max_fraction):
                dense.append(bucket)
            else:
                parts.append(_encode(bucket, cs, bucket_codes, tensors, stats.checksums))
        size = sum(p.numel() for p in parts)
        piece = torch.empty(0, dtype=torch.uint8)
        if size:  # nothing changed: the header says so, the receiver only checksums
            piece = torch.cat([*parts, torch.tensor([size], dtype=torch.int64).view(torch.uint8)])
            sent.append((transport.isend(piece, peer), piece))
        stats.bytes += piece.numel()
        stats.buckets += len(parts)
    _check(cancel)
    if dense:
        _add(stats, send_buckets(dense, tensors, transport, {dst: peer}, options, cancel=cancel, cache=cache))
    for handle, _ in sent:
        handle.wait(options.timeout_s)


def _dense_whole(link: Sequence[Bucket], tensors, diffs: Diffs, dst: str, max_fraction: float) -> bool:
    """Whether every bucket of `link` goes dense, found without an exact comparison of any big tensor
    (a step that changes everything: every tensor's sample says so). Where the samples settle every
    bucket (`_dense_by_samples`), its small tensors are not compared either: they go dense, counted
    as all changed. Its receiver then waits for one header instead of one a group before its dense
    buckets can move (on loopback, 12 headers of 4 senders took a tenth of a dense refit), and
    every sender's header waits for this."""
    units = [u for b in link for u in b.units]
    diffs.presample(units, tensors)  # the whole link's, once: its groups' comparisons use them too
    with diffs.lock:  # another stage's link may be comparing the same tensors
        by_samples = all(_dense_by_samples(b, diffs, max_fraction) for b in link)
    if by_samples:  # its small tensors need no comparison before the header
        diffs.assume_dense(units, dst)
        return True
    return all(diffs.known_cheaply(u, tensors) for u in units) and all(
        _dense_bucket([_header_code(diffs.of(u, tensors, dst)) for u in b.units], b, max_fraction)
        for b in link
    )


def _dense_by_samples(bucket: Bucket, diffs: Diffs, max_fraction: float) -> bool:
    """Whether `bucket` goes dense whatever its other units' comparisons find: the bytes of its
    units known dense without one (`Diffs.dense_without_comparing`) are already more than its delta
    may take (`_dense_bucket`; a unit's delta bytes are at least 0)."""
    if any(u.quantized for u in bucket.units):
        return True
    known = [diffs.dense_without_comparing(u) for u in bucket.units]
    return all(known) or (
        sum(_aligned(u.nbytes) for u, dense in zip(bucket.units, known) if dense)
        > max_fraction * bucket.nbytes
    )


def _encode(
    bucket: Bucket, changes: list[Change], codes: list[int], tensors, checksums: dict
) -> torch.Tensor:
    message = torch.zeros(sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units)), dtype=torch.uint8)
    sums, offset = Checksums(), 0
    for u, change, code in zip(bucket.units, changes, codes):
        new = _new_values(u, tensors)
        sums.add_region(checksum_key(u.canonical, u.canon), new)
        size = _unit_bytes(code, u)
        part = message[offset : offset + size]
        offset += size
        if code < 0:
            part[: u.nbytes].view(new.dtype).view(new.shape).copy_(new)
            continue
        assert change.index is not None and change.values is not None  # code >= 0: a delta unit
        index_bytes = _aligned(code * _INDEX.itemsize)
        part[: code * _INDEX.itemsize].copy_(change.index.view(torch.uint8))
        part[index_bytes : index_bytes + code * new.element_size()].copy_(change.values.view(torch.uint8))
    checksums.update(sums.result())
    return message


class LinkForward(Protocol):
    """A relay's part in a delta refit (`syncd.member.dataplane.relay.DeltaForwarder`): what
    arrives on one incoming link goes on, as it came, to the successors that receive that link."""

    def header(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        """A group's header arrived in `data`: send it on."""
        ...

    def message(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        """A group's piece (its buckets' delta encodings) arrived in `data`: send it on."""
        ...

    def dense(self, dense: Sequence[Bucket], tensors, options: LoopOptions) -> TransferStats:
        """Receive the link's `dense` buckets into `tensors`, forwarding each."""
        ...


class Undo(Protocol):
    """Keeps what a delta overwrites, so a failed refit can put it back (`generator_svc.undo_log`)."""

    def save(self, region: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Called before the delta writes `region` at flat positions `index` (all of it: None)."""
        ...


class DeltaSink(Protocol):
    """A receiver that applies deltas to its live tensors (the generator's in-place install):
    the tensors holding the base version, and the undo log to save into before each write."""

    def delta_targets(self) -> tuple[Mapping[str, torch.Tensor], Undo]: ...


def recv_with_deltas(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor] | DeltaSink,
    transport: Transport,
    ranks: Mapping[str, int],
    links: DeltaLinks,
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
    forward: LinkForward | None = None,
) -> DeltaStats:
    """The receiving side of `send_with_deltas`, for a member whose links all go as deltas: applies
    each delta to `tensors` (which must hold the base version) and checksums every whole region.
    `buckets` are those this member receives; `forward`: it relays them (fan-out). A `DeltaSink`
    names its tensors and an undo log that saves what each write overwrites.

    Link by link, group by group, its header, then its piece, taken (and forwarded) by a thread of
    their own (`_Taker`) while this one applies the pieces taken before; then one pipelined loop
    over all the links' dense buckets: each peer's messages come in its order (headers and
    pieces, dense buckets), and a relay forwards them in the order it takes them, which its
    successors take them in; no link waits for the previous link's dense buckets (and a relay for
    its forwards), and a link's changes are in place while a later sender is still comparing."""
    stats, start = DeltaStats(), time.perf_counter()
    undo: Undo | None = None
    if not isinstance(tensors, Mapping):
        tensors, undo = tensors.delta_targets()
    with options.gc_paused():  # as `send_with_deltas`
        taker = _Taker(_origin_links(buckets), transport, ranks, links.max_fraction, options, forward, cancel)
        dense: list[Bucket] = []
        try:
            for arrived in taker.arrivals():
                dense += _apply_group(arrived, tensors, stats, undo)
        finally:
            taker.stop()
        _check(cancel)
        if dense and undo is not None:  # the executor overwrites these units whole
            for u in [u for b in dense for u in b.units]:
                undo.save(tensors[u.dst_tensor][u.dst_box.slices()])
        if dense and forward is not None:
            _add(stats, forward.dense(dense, tensors, options))
        elif dense:
            _add(stats, recv_buckets(dense, tensors, transport, ranks, options, cancel=cancel, cache=cache))
    stats.seconds = time.perf_counter() - start
    return stats


def _groups(link: Sequence[Bucket]) -> list[list[Bucket]]:
    """A link's buckets cut, in order, into groups of at most `_GROUP_BYTES` (at least one bucket):
    each group is one header and one piece. Sender and receivers cut alike, from the plan alone."""
    groups: list[list[Bucket]] = []
    size = 0
    for bucket in link:
        if groups and size + bucket.nbytes <= _GROUP_BYTES:
            groups[-1].append(bucket)
            size += bucket.nbytes
        else:
            groups.append([bucket])
            size = bucket.nbytes
    return groups


@dataclass
class _Arrived:
    """One group of a delta link as it arrived (`_Taker`): its buckets that go dense (received later,
    with the others), those that go as deltas with their codes and bytes in `piece`, in order."""

    group: list[Bucket]
    dense: list[Bucket] = field(default_factory=list)
    sparse: list[tuple[Bucket, list[int], int]] = field(default_factory=list)
    piece: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    elements: int = 0  # of all its units, and how many of them changed
    changed: int = 0
    touched: set[str] = field(default_factory=set)  # destination tensors that take new values
    rest_dense: bool = False  # its header said every later group of the link goes dense

    @classmethod
    def dense_whole(cls, group: list[Bucket]) -> _Arrived:
        """A group after a header with `rest_dense`: all of it dense, counted as all changed (its
        sender compared it, but sent no header of it)."""
        numel = sum(u.canon.numel for b in group for u in b.units)
        touched = {u.dst_tensor for b in group for u in b.units}
        return cls(group, dense=list(group), elements=numel, changed=numel, touched=touched)


class _Taker:
    """Takes a receiver's delta links group by group on a thread of its own: each group's header,
    then its piece (sized from the header), each forwarded as it arrived (a relay). Gloo sends a
    message only once its receive is posted, so taking the next group while the previous one is
    applied keeps the wire, and every hop of a chain after this one, moving."""

    def __init__(
        self,
        links: Mapping[tuple[str, str], list[Bucket]],
        transport: Transport,
        ranks: Mapping[str, int],
        max_fraction: float,
        options: LoopOptions,
        forward: LinkForward | None,
        cancel: threading.Event | None,
    ) -> None:
        self._links, self._transport, self._ranks = list(links.values()), transport, ranks
        self._max_fraction, self._options, self._forward = max_fraction, options, forward
        self._cancel, self._stopped = cancel, threading.Event()
        self._queue: queue.SimpleQueue[_Arrived | BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="delta-take", daemon=True)
        self._thread.start()

    def arrivals(self) -> Iterator[_Arrived]:
        """The groups in the order they arrive; raises what stopped the taking."""
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
        self._thread.join()

    def stop(self) -> None:
        """No more groups after the one being taken (the applier failed); a receive waiting for its
        message ends with the transfer's timeout or abort."""
        self._stopped.set()

    def _run(self) -> None:
        try:
            groups: list[tuple[Sequence[Bucket], list[Bucket], int]] = []
            ends: list[int] = []  # per group, the index of the first group of the next link
            for origin in self._links:
                cut = _groups(origin)
                groups += [(origin, g, self._ranks[origin[0].src]) for g in cut]
                ends += [len(groups)] * len(cut)
            header = self._header(*groups[0]) if groups else None
            i = 0
            while i < len(groups):
                if self._stopped.is_set():
                    return
                _check(self._cancel)
                assert header is not None  # the first posted above, each next one by `_take`
                link, group, peer = groups[i]
                after = groups[i + 1] if i + 1 < len(groups) else None
                after_link = groups[ends[i]] if ends[i] < len(groups) else None
                header, arrived = self._take(link, group, peer, header, after, after_link)
                self._queue.put(arrived)
                if arrived.rest_dense:
                    for later in groups[i + 1 : ends[i]]:
                        self._queue.put(_Arrived.dense_whole(later[1]))
                i = ends[i] if arrived.rest_dense else i + 1
        except BaseException as e:  # noqa: BLE001 - handed to the applier, which raises it
            self._queue.put(e)
        else:
            self._queue.put(None)

    def _header(self, link: Sequence[Bucket], group: list[Bucket], peer: int) -> _Incoming:
        buf = torch.empty(sum(len(b.units) for b in group) + 1, dtype=torch.int64)
        return _Incoming(buf, self._transport, peer, group)

    def _take(
        self,
        link: Sequence[Bucket],
        group: list[Bucket],
        peer: int,
        header: _Incoming,
        after: tuple[Sequence[Bucket], list[Bucket], int] | None,
        after_link: tuple[Sequence[Bucket], list[Bucket], int] | None,
    ) -> tuple[_Incoming | None, _Arrived]:
        """The group whose `header` was posted: its piece received, and the next header posted
        behind it, so its sender sends it as soon as it has it (one wait for a posted receive per
        group, not two): the group `after` it, or the first of the next link (`after_link`) when
        the header says the rest of this link goes dense. Returns that header and the group."""
        codes_buf = header.wait(self._options.timeout_s)
        if self._forward is not None:
            self._forward.header(link, codes_buf)
        flat_codes, at = codes_buf[:-1].tolist(), 0
        arrived = _Arrived(group, rest_dense=header.rest_dense)
        for bucket in group:
            codes = flat_codes[at : at + len(bucket.units)]
            at += len(bucket.units)
            _check_codes(bucket, codes)
            arrived.elements += sum(u.canon.numel for u in bucket.units)
            arrived.changed += sum(c if c >= 0 else -1 - c for c in codes)
            if _dense_bucket(codes, bucket, self._max_fraction):
                arrived.dense.append(bucket)
                arrived.touched.update(u.dst_tensor for u in bucket.units)
            else:
                size = sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units))
                arrived.sparse.append((bucket, codes, size))
                arrived.touched.update(u.dst_tensor for u, c in zip(bucket.units, codes) if c)
        size = sum(size for _, _, size in arrived.sparse)
        piece = (
            _Incoming(torch.empty(size + _TRAILER, dtype=torch.uint8), self._transport, peer, group)
            if size
            else None
        )
        following = after_link if arrived.rest_dense else after
        next_header = self._header(*following) if following is not None else None
        if piece is not None:
            arrived.piece = piece.wait(self._options.timeout_s)
            if self._forward is not None:
                self._forward.message(link, arrived.piece)
        return next_header, arrived


def _apply_group(
    arrived: _Arrived, tensors: Mapping[str, torch.Tensor], stats: DeltaStats, undo: Undo | None
) -> list[Bucket]:
    """Apply one group's piece bucket by bucket, checksumming whole regions; count it in `stats`.
    Returns its dense buckets."""
    stats.elements += arrived.elements
    stats.changed += arrived.changed
    stats.touched |= arrived.touched
    offset = 0
    for bucket, codes, size in arrived.sparse:
        _apply(bucket, codes, arrived.piece[offset : offset + size], tensors, stats.checksums, undo)
        offset += size
    stats.bytes += arrived.piece.numel()
    stats.buckets += len(arrived.sparse)
    return arrived.dense


class _Incoming:
    """A header (int64) or piece (uint8) being received into `buf`, whose last 8 bytes, its trailer,
    the sender set to the count of the codes (header) or bytes (piece) before it. Gloo takes a
    message shorter than the buffer without a word: a truncated one leaves the sentinel put there
    first. Posted at construction, so the sender may send it while the receiver does other work."""

    def __init__(self, buf: torch.Tensor, transport: Transport, peer: int, group: Sequence[Bucket]) -> None:
        self.buf, self._peer, self._group = buf, peer, group
        self.rest_dense = False  # a header whose trailer adds `_REST_DENSE`
        buf.view(torch.int64)[-1] = -1
        self._handle = transport.irecv(buf, peer)

    def wait(self, timeout_s: float) -> torch.Tensor:
        """The message, its trailer checked."""
        self._handle.wait(timeout_s)
        what = "header" if self.buf.dtype == torch.int64 else "piece"
        words = self.buf.view(torch.int64)
        expected = (words.numel() - 1) * (1 if what == "header" else 8)
        self.rest_dense = what == "header" and int(words[-1]) == expected + _REST_DENSE
        if int(words[-1]) != expected and not self.rest_dense:
            raise TransferError(
                f"delta {what} of the group from bucket {self._group[0].key} arrived truncated or "
                f"corrupt: its trailer says {int(words[-1])}, {expected} expected",
                self._peer,
            )
        return self.buf


def _check_codes(bucket: Bucket, codes: list[int]) -> None:
    """A header's codes must describe the bucket's units (a corrupt one would size the piece
    wrong and leave the link waiting for bytes that never come)."""
    for u, code in zip(bucket.units, codes):
        changed = code if code >= 0 else -1 - code
        if changed > u.canon.numel:
            raise ValueError(
                f"delta header of bucket {bucket.key}: unit {u.canonical} has {u.canon.numel} "
                f"elements, the header says {changed} changed (code {code})"
            )


def _origin_links(buckets: Sequence[Bucket]) -> dict[tuple[str, str], list[Bucket]]:
    """A receiver's links cut by the sender that packed their bytes: each part is one sender's
    delta (its header, its message, its dense buckets). A relay's link to its successor carries
    what it received from each sender, in the order it received them (the planner numbers relay
    buckets so), each forwarded as it came."""
    out: dict[tuple[str, str], list[Bucket]] = defaultdict(list)
    for b in sorted(buckets, key=lambda b: (b.src, b.index)):
        out[(b.src, b.origin)].append(b)
    return out


def _apply(
    bucket: Bucket,
    codes: list[int],
    message: torch.Tensor,
    tensors,
    checksums: dict,
    undo: Undo | None = None,
) -> None:
    sums, offset = Checksums(), 0
    for u, code in zip(bucket.units, codes):
        dst = tensors[u.dst_tensor][u.dst_box.slices()]
        size = _unit_bytes(code, u)
        part = message[offset : offset + size]
        offset += size
        if code < 0:
            if undo is not None:
                undo.save(dst)
            dst.copy_(part[: u.nbytes].view(dst.dtype).view(dst.shape))
        elif code:
            index_bytes = _aligned(code * _INDEX.itemsize)
            index = part[: code * _INDEX.itemsize].view(_INDEX)
            values = part[index_bytes : index_bytes + code * dst.element_size()].view(dst.dtype)
            _check_positions(bucket, u, index)
            if undo is not None:
                undo.save(dst, index)
            _scatter_box(tensors[u.dst_tensor], u.dst_box, dst, index, values)
        sums.add_region(checksum_key(u.canonical, u.canon), dst)
    checksums.update(sums.result())


def _check_positions(bucket: Bucket, u: TransferUnit, index: torch.Tensor) -> None:
    """A delta unit's positions must ascend strictly within the unit (the sender lists them so;
    `_scatter_box` cuts them by run on it), or a corrupt piece could write outside its region."""
    at = index.numpy()
    if at[0] < 0 or at[-1] >= u.canon.numel or not bool(np.all(at[1:] > at[:-1])):
        raise ValueError(
            f"delta piece of bucket {bucket.key}: unit {u.canonical} has {u.canon.numel} elements, "
            f"its positions (from {int(at.min())} to {int(at.max())}) do not ascend within them"
        )


def _scatter_box(
    parent: torch.Tensor, box: Box, dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> None:
    """`scatter_flat(dst, index, values)` for `dst`, `box` of `parent`, with `index` ascending
    (`_check_positions`). On CPU with a contiguous parent, the box's few contiguous runs each take
    their slice of the positions by a binary search, as numpy assignments (half the time of
    torch's `index_copy_` here, and no int64 arithmetic per position); with many runs, positions in
    the box's C order become the parent's flat positions through the runs, one `index_copy_`."""
    if parent.device.type != "cpu" or not parent.is_contiguous():
        scatter_flat(dst, index, values)
        return
    starts, run = _box_runs(tuple(parent.shape), box)
    if len(starts) > _FEW_RUNS:
        flat_at = index.long()
        parent.view(-1).index_copy_(0, starts[flat_at // run] + flat_at % run, values)
        return
    flat, at, new = _bits(parent.view(-1)).numpy(), index.numpy(), _bits(values).numpy()
    cuts = [0, *np.searchsorted(at, np.arange(1, len(starts)) * run).tolist(), at.size]
    for r, start in enumerate(starts.tolist()):
        lo, hi = cuts[r], cuts[r + 1]
        if lo < hi:
            flat[start : start + run][at[lo:hi] - r * run if r else at[lo:hi]] = new[lo:hi]


def scatter_flat(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """dst.flatten()[index] = values, in place, also for a region that is not contiguous."""
    if dst.is_contiguous():
        dst.view(-1).index_copy_(0, index.long(), values)
    else:
        dst.index_put_(unravel_flat(index.long(), dst.shape), values)


def unravel_flat(flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Coordinates of C-order flat positions (torch.unravel_index imports sympy on first use,
    a third of a second inside the first refit)."""
    coords = []
    for extent in reversed(shape):
        coords.append(flat % extent)
        flat = flat // extent
    return tuple(reversed(coords))


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise TransferAborted("transfer aborted")
