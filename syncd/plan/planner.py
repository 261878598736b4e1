"""The planner: a pure function from two sets of catalogs to transfer units packed into buckets.

How it works, per canonical tensor:
1. Cut the canonical tensor into *cells* along every boundary of every source box (coordinate
   compression). Each cell lists the sources that hold all of it: its replicas.
2. Intersect every destination piece with the cells it touches. A touched cell without a replica
   is an element no source covers: an error naming the tensor, raised before anything moves.
3. Each (cell, destination piece) intersection becomes one transfer unit from one replica, chosen
   as the least-loaded so far, so replicated data is sent once and spread over its holders.
Each side declares the dtype it holds a canonical tensor in; when they differ, units record the
conversion and are sized in the destination's dtype, since the sender converts while packing.
A blockwise-FP8 destination (`syncd.plan.fp8_blocks`) declares a projection weight in e4m3 and
its scales `<weight>_scale_inv`, which no source declares: both are planned from the sources'
weight, whose boxes must hold whole blocks; the scales on the weight's block grid.
Units larger than a bucket are cut into slabs; the units of each (stage, src, dst) link are
packed greedily, in a deterministic order, into buckets of at most `bucket_bytes`.

A destination that installs while it receives (`DestMember.by_layer`) keeps a layer's received
parts until the whole layer arrived. Its layers are therefore grouped, in its catalog's order, into
runs of whole layers of at most `bucket_bytes` together (over all its links), and every link's
buckets into it end where a group ends: the receiver, taking buckets in catalog order, holds at
most one group open, so its extra memory stays within its receive buffer plus one bucket. A layer
larger than a bucket is a group of its own (then that layer is what it holds).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from syncd.layout import (
    Box,
    CanonicalTensor,
    Catalog,
    Conversion,
    Piece,
    conversion,
    dtype_bytes,
    owning_layer,
)
from syncd.layout.catalog import first_overlap
from syncd.plan import fp8_blocks
from syncd.plan.types import Bucket, DestMember, Plan, SourceMember, TransferUnit
from syncd.vocabulary import Fp8Part

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class _Holding:
    """One piece of one member's local tensor."""

    member: int
    tensor: str
    piece: Piece


def make_plan(
    sources: Sequence[SourceMember],
    destinations: Sequence[DestMember],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Plan:
    """Plan a refit. Raises ValueError (naming the tensor) if members disagree on a canonical
    tensor's shape, if the members of one side disagree on its dtype, if the sources' dtype cannot
    be converted to the destinations' (`syncd.layout.dtypes.conversion`), if destination boxes
    overlap, or if a destination element has no source. Units carry the destination's dtype (their
    `nbytes` are wire bytes) and the conversion the sender applies while packing. When every source
    is `partial`, only the canonical tensors some source declares are planned (a refit of the
    changed tensors: the destinations keep the rest)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    ids = [m.member_id for m in sources] + [m.member_id for m in destinations]
    if len(set(ids)) != len(ids):
        raise ValueError(f"member ids must be unique, got {sorted(ids)}")
    meta = _canonical_meta(sources, destinations)
    src_holdings = _holdings_by_canonical([m.catalog for m in sources])
    dst_holdings = _holdings_by_canonical([m.catalog for m in destinations])
    load = [0] * len(sources)
    links: dict[tuple[int, int], list[TransferUnit]] = defaultdict(list)
    members = [m.member_id for m in sources]
    # In the destinations' catalog order (the first destination's tensors first), not by name: a
    # generator's catalog lists its parameters layer by layer, so every link's units, and so its
    # buckets, go through the layers in the same order, which lets an in-place receiver finish a
    # layer before the next one opens (by name, "lm_head" came before every layer).
    partial = all(m.catalog.partial for m in sources)
    for name in dst_holdings:
        if partial and name not in meta:
            continue  # no partial source sends it: the destinations keep what they serve
        holders = src_holdings.get(meta[name].source if name in meta else name)
        if not holders:
            raise ValueError(f"no source holds canonical tensor {name}, which a destination needs")
        _check_destination_overlap(name, dst_holdings[name])
        if meta[name].quantized:
            fp8_blocks.require_whole_blocks(
                meta[name].source,
                meta[name].source_shape,
                [(members[h.member], h.piece.canon) for h in holders],
            )
        limit = max(1, bucket_bytes // dtype_bytes(meta[name].tensor.dtype))
        for src, dst, unit in _units_for_tensor(meta[name], holders, dst_holdings[name], load, limit):
            links[(src, dst)].append(unit)
    return _pack(links, sources, destinations, bucket_bytes)


@dataclass(frozen=True, slots=True)
class _Declared:
    """A canonical tensor as the first member of one side that declares it has it."""

    tensor: CanonicalTensor
    member_id: str


@dataclass(frozen=True, slots=True)
class _TensorMeta:
    """A canonical tensor as both sides see it: the destination's declaration (its dtype is what
    travels on the wire), the conversion the sender applies while packing, and the canonical tensor
    the sender reads: the same one, or for FP8 scales their weight (`quantized` says which output
    of the block quantizer a unit carries)."""

    tensor: CanonicalTensor
    conversion: Conversion
    source: str
    source_shape: tuple[int, ...]
    quantized: Fp8Part | None = None

    def reads(self, box: Box) -> Box:
        """The canonical box of `source` that a unit over `box` of this tensor is made from."""
        if self.quantized == Fp8Part.VALUES:
            return fp8_blocks.whole_blocks(box, self.source_shape)
        if self.quantized == Fp8Part.SCALES:
            return fp8_blocks.from_grid(box, self.source_shape)
        return box

    def covers(self, source_box: Box) -> Box:
        """The box of this tensor that a source's canonical `source_box` lets it send."""
        return fp8_blocks.to_grid(source_box) if self.quantized == Fp8Part.SCALES else source_box


def _declarations(members: Sequence[SourceMember] | Sequence[DestMember]) -> dict[str, _Declared]:
    """Each canonical tensor one side declares; the members of a side must agree on shape and dtype."""
    out: dict[str, _Declared] = {}
    for m in members:
        for c in m.catalog.canonical:
            seen = out.get(c.name)
            if seen is None:
                out[c.name] = _Declared(c, m.member_id)
            elif seen.tensor != c:
                raise ValueError(
                    f"canonical tensor {c.name} disagrees: {seen.member_id} has "
                    f"{seen.tensor.dtype}{list(seen.tensor.shape)}, "
                    f"{m.member_id} has {c.dtype}{list(c.shape)}"
                )
    return out


def _canonical_meta(
    sources: Sequence[SourceMember], destinations: Sequence[DestMember]
) -> dict[str, _TensorMeta]:
    """Per canonical tensor both sides declare: shapes must agree; dtypes may differ by a supported
    conversion (anything else is refused here, before any byte moves)."""
    src = _declarations(sources)
    dsts = _declarations(destinations)
    meta: dict[str, _TensorMeta] = {}
    for name, dst in dsts.items():
        weight = fp8_blocks.scaled_weight(name)
        if name not in src and weight is not None and weight in src and weight in dsts:
            meta[name] = _scales_meta(dst, src[weight], dsts[weight])
            continue
        held = src.get(name)
        if held is None:
            continue  # an error only if a destination tensor needs it (make_plan says which)
        _require_same_shape(name, held, dst, held.tensor.shape)
        quantized = fp8_blocks.quantizes(name, held.tensor.dtype, dst.tensor.dtype)
        if quantized and fp8_blocks.scale_name(name) not in dsts:
            raise ValueError(
                f"canonical tensor {name}: {dst.member_id} holds it as {dst.tensor.dtype} but does "
                f"not declare its block scales {fp8_blocks.scale_name(name)}"
            )
        conv = (
            Conversion(held.tensor.dtype, dst.tensor.dtype)
            if quantized
            else conversion(held.tensor.dtype, dst.tensor.dtype, tensor=name)
        )
        meta[name] = _TensorMeta(
            dst.tensor, conv, name, held.tensor.shape, Fp8Part.VALUES if quantized else None
        )
    return meta


def _scales_meta(dst: _Declared, weight_src: _Declared, weight_dst: _Declared) -> _TensorMeta:
    """The scales of an FP8 weight, planned from the sources' (wider) weight."""
    name, weight = dst.tensor.name, weight_src.tensor
    if not fp8_blocks.quantizes(weight.name, weight.dtype, weight_dst.tensor.dtype):
        raise ValueError(
            f"canonical tensor {name}: scales of {weight.name}, which {weight_dst.member_id} "
            f"declares as {weight_dst.tensor.dtype}, not {fp8_blocks.FP8_DTYPE} from a wider source"
        )
    expected = CanonicalTensor(name, fp8_blocks.scale_shape(weight.shape), fp8_blocks.SCALE_DTYPE)
    if dst.tensor != expected:
        raise ValueError(
            f"canonical tensor {name}: {dst.member_id} declares {dst.tensor.dtype}"
            f"{list(dst.tensor.shape)}; the block scales of {weight.name}{list(weight.shape)} "
            f"are {expected.dtype}{list(expected.shape)}"
        )
    return _TensorMeta(
        dst.tensor, Conversion(weight.dtype, dst.tensor.dtype), weight.name, weight.shape, Fp8Part.SCALES
    )


def _require_same_shape(name: str, held: _Declared, dst: _Declared, shape: tuple[int, ...]) -> None:
    if shape != dst.tensor.shape:
        raise ValueError(
            f"canonical tensor {name} disagrees: {held.member_id} has {held.tensor.dtype}"
            f"{list(held.tensor.shape)}, {dst.member_id} has {dst.tensor.dtype}{list(dst.tensor.shape)}"
        )


def _holdings_by_canonical(catalogs: Sequence) -> dict[str, list[_Holding]]:
    out: dict[str, list[_Holding]] = defaultdict(list)
    for i, catalog in enumerate(catalogs):
        for t in catalog.tensors:
            for p in t.pieces:
                out[p.canonical].append(_Holding(i, t.name, p))
    return out


def _check_destination_overlap(name: str, holdings: list[_Holding]) -> None:
    per_member: dict[int, list[Box]] = defaultdict(list)
    for h in holdings:
        per_member[h.member].append(h.piece.canon)
    for boxes in per_member.values():
        pair = first_overlap(boxes)
        if pair is not None:
            raise ValueError(f"destination boxes {pair[0]} and {pair[1]} of {name} overlap on one member")


def _units_for_tensor(
    meta: _TensorMeta,
    sources: list[_Holding],
    dests: list[_Holding],
    load: list[int],
    max_elements: int,
) -> Iterator[tuple[int, int, TransferUnit]]:
    tensor, conv = meta.tensor, meta.conversion
    wire_itemsize = dtype_bytes(tensor.dtype)
    src_dtype = None if conv.is_identity else conv.src
    covered = [meta.covers(h.piece.canon) for h in sources]
    cuts = [
        sorted({0, n, *(b.start[d] for b in covered), *(b.stop[d] for b in covered)})
        for d, n in enumerate(tensor.shape)
    ]
    replicas: dict[tuple[int, ...], list[_Holding]] = defaultdict(list)
    for h, box in zip(sources, covered):
        for cell in _cells(cuts, box):
            replicas[cell].append(h)
    for dst in dests:
        for cell in _cells(cuts, dst.piece.canon):
            holders = replicas.get(cell)
            cell_box = Box(
                tuple(c[i] for c, i in zip(cuts, cell)), tuple(c[i + 1] for c, i in zip(cuts, cell))
            )
            sub = cell_box.intersect(dst.piece.canon)
            assert sub is not None  # cells come from the destination box's own range
            if not holders:
                raise ValueError(f"no source covers region {sub} of canonical tensor {tensor.name}")
            src = min(holders, key=lambda h: (load[h.member], h.member))
            load[src.member] += sub.numel * wire_itemsize
            # FP8 values are cut at whole blocks, so that no block is quantized for two units.
            align = fp8_blocks.BLOCK[0] if meta.quantized == Fp8Part.VALUES else 1
            for slab in _slabs(sub, max_elements, align):
                read = meta.reads(slab)
                yield (
                    src.member,
                    dst.member,
                    TransferUnit(
                        canonical=tensor.name,
                        canon=slab,
                        dtype=tensor.dtype,
                        src_tensor=src.tensor,
                        src_box=src.piece.local_region(read),
                        dst_tensor=dst.tensor,
                        dst_box=dst.piece.local_region(slab),
                        nbytes=slab.numel * wire_itemsize,
                        src_dtype=src_dtype,
                        quantized=meta.quantized,
                        block_box=read if meta.quantized else None,
                    ),
                )


def _cells(cuts: list[list[int]], box: Box) -> Iterator[tuple[int, ...]]:
    """Indices of the grid cells inside `box` (cut points always include the box's bounds for
    sources; for destinations a cell may stick out and is clipped by the caller)."""
    ranges = []
    for c, lo, hi in zip(cuts, box.start, box.stop):
        first = bisect.bisect_right(c, lo) - 1
        last = bisect.bisect_left(c, hi)
        ranges.append(range(first, last))
    return itertools.product(*ranges)


def _slabs(box: Box, max_elements: int, align: int = 1) -> Iterator[Box]:
    """Cut `box` into C-order slabs of at most `max_elements` elements (itself when it fits); cuts
    on the last two dims fall at multiples of `align` (relative to the box) where a slab of
    `align` rows fits."""
    if box.numel <= max_elements:
        yield box
        return
    d = next(d for d, n in enumerate(box.shape) if n > 1)
    inner = box.numel // box.shape[d]
    if inner <= max_elements:
        step = max_elements // inner
        if d >= box.rank - 2 and step >= align:
            step -= step % align
        for lo in range(box.start[d], box.stop[d], step):
            yield _with_dim(box, d, lo, min(lo + step, box.stop[d]))
    else:
        for lo in range(box.start[d], box.stop[d]):
            yield from _slabs(_with_dim(box, d, lo, lo + 1), max_elements, align)


def _with_dim(box: Box, d: int, lo: int, hi: int) -> Box:
    start, stop = list(box.start), list(box.stop)
    start[d], stop[d] = lo, hi
    return Box(tuple(start), tuple(stop))


def _pack(
    links: dict[tuple[int, int], list[TransferUnit]],
    sources: Sequence[SourceMember],
    destinations: Sequence[DestMember],
    bucket_bytes: int,
) -> Plan:
    buckets: list[Bucket] = []
    stage_members: dict[int, set[str]] = defaultdict(set)
    layer_groups = {
        d: _layer_groups(dst, links, d, bucket_bytes) for d, dst in enumerate(destinations) if dst.by_layer
    }
    for (s, d), units in sorted(links.items(), key=lambda kv: (sources[kv[0][0]].stage, kv[0])):
        src, dst = sources[s], destinations[d]
        stage_members[src.stage].update((src.member_id, dst.member_id))
        group_of = layer_groups.get(d)
        if group_of is not None:  # in the destination's own catalog order (`landing_order`)
            units = sorted(units, key=_landing_key(dst.catalog))
        groups: list[list[TransferUnit]] = [[]]
        size = 0
        for unit in units:
            full = size + unit.nbytes > bucket_bytes
            if groups[-1] and (
                full
                or (group_of is not None and group_of[unit.dst_tensor] != group_of[groups[-1][-1].dst_tensor])
            ):
                groups.append([])
                size = 0
            groups[-1].append(unit)
            size += unit.nbytes
        for index, group in enumerate(groups):
            nbytes = sum(u.nbytes for u in group)
            buckets.append(Bucket(src.stage, src.member_id, dst.member_id, index, tuple(group), nbytes))
    return Plan(
        buckets=tuple(buckets),
        bucket_bytes=bucket_bytes,
        stage_members={k: tuple(sorted(v)) for k, v in sorted(stage_members.items())},
    )


def _layer_groups(
    dst: DestMember, links: dict[tuple[int, int], list[TransferUnit]], d: int, bucket_bytes: int
) -> dict[str, int]:
    """For a `by_layer` destination: its tensors' group numbers. Layers (`owning_layer`) are taken
    in the destination's catalog order and grouped greedily while the bytes it receives for them,
    from every source, fit in `bucket_bytes`."""
    received: dict[str, int] = defaultdict(int)
    for (_, dd), units in links.items():
        if dd == d:
            for u in units:
                received[owning_layer(u.dst_tensor)] += u.nbytes
    group_of_layer: dict[str, int] = {}
    group, size = 0, 0
    for t in dst.catalog.tensors:
        layer = owning_layer(t.name)
        if layer in group_of_layer:
            continue
        if size and size + received[layer] > bucket_bytes:
            group, size = group + 1, 0
        group_of_layer[layer] = group
        size += received[layer]
    return {t.name: group_of_layer[owning_layer(t.name)] for t in dst.catalog.tensors}


def landing_order(catalog: Catalog) -> Callable[[Bucket], tuple]:
    """The order in which a `by_layer` destination takes its buckets: by where each lands in its
    catalog (first unit's tensor, then its box start). Catalogs list parameters layer by layer, so
    every group of `_layer_groups` arrives whole before the next one starts."""
    key = _landing_key(catalog)
    return lambda bucket: key(bucket.units[0])


def _landing_key(catalog: Catalog) -> Callable[[TransferUnit], tuple]:
    index = {t.name: i for i, t in enumerate(catalog.tensors)}
    return lambda unit: (index[unit.dst_tensor], unit.dst_box.start)
