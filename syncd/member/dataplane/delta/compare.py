"""The sender's side of a delta before anything is sent: its `Mirror` (what it last sent) and one
refit's comparisons with it (`Diffs`): per unit, how many elements changed and, for a unit that
goes as a delta, their positions and values; a tensor mostly changed by its sample goes dense
without the exact comparison.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane.delta.scatter import _FEW_RUNS, _bits, _box_runs, _scatter_box
from syncd.member.dataplane.delta.wire import _INDEX, _sparse_bytes
from syncd.plan.types import TransferUnit
from syncd.weight_version import WeightVersion


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
