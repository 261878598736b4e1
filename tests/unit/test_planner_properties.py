"""Property tests: random canonical tensors, random source/destination layouts and random
supported dtype pairs in, bit-exact arrays out (executed by the NumPy reference data plane, whose
casts must equal torch's)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncd.layout import (
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    InterleavedShard,
    Replicate,
    Shard,
    Sharded,
    dtype_bytes,
    local_tensor,
    owning_layer,
)
from syncd.layout.dtypes import CASTS, torch_dtype
from syncd.member.dataplane.executor import interleaved
from syncd.plan import DestMember, SourceMember, landing_order, make_plan
from syncd.plan.simulate import NUMPY_DTYPES, execute, materialize

DTYPE_PAIRS = sorted(CASTS | {(d, d) for d in ("float32", "bfloat16", "float16")})
# Values where casts go wrong: signed zeros, infinities, NaN, bfloat16 ties (to even: down, up),
# overflow to infinity in bfloat16 and float16, float32 and float16 subnormals.
SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, 65520.0, 1e-40, 6e-8],
    dtype=np.float32,
)


@st.composite
def tensor_groups(draw):
    """Groups of canonical tensors that share all dims but dim 0, so they can be fused."""
    groups = []
    for g in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 4))
        trailing = tuple(draw(st.lists(st.integers(1, 5), min_size=rank - 1, max_size=rank - 1)))
        sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
        groups.append([CanonicalTensor(f"g{g}.t{i}", (n, *trailing), "float32") for i, n in enumerate(sizes)])
    return groups


@st.composite
def placements(draw, rank: int, mesh: tuple[int, ...], extents: tuple[int, ...]):
    out = []
    used_interleave = set()
    for _ in mesh:
        kind = draw(st.sampled_from(["replicate", "shard", "interleave"]))
        dim = draw(st.integers(0, rank - 1))
        divisors = [s for s in range(2, extents[dim] + 1) if extents[dim] % s == 0]
        if kind == "interleave" and divisors and dim not in used_interleave and not out:
            used_interleave.add(dim)
            out.append(InterleavedShard(dim, draw(st.sampled_from(divisors))))
        elif kind == "replicate":
            out.append(Replicate())
        else:
            out.append(Shard(dim))
    return tuple(out)


@st.composite
def side(draw, groups, prefix: str, dtype: str = "float32"):
    """A random mesh and, for every member, a catalog built with the layout expressions, holding
    every tensor in `dtype`."""
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    exprs = []
    for g, tensors in enumerate(groups):
        rank = len(tensors[0].shape)
        style = draw(st.sampled_from(["plain", "concat_of_shards", "shard_of_concat"]))
        if style == "plain" or len(tensors) == 1:
            exprs.extend((t.name, [t], draw(placements(rank, mesh, t.shape)), "plain") for t in tensors)
        else:
            fused = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
            exprs.append((f"g{g}.fused", tensors, draw(placements(rank, mesh, fused)), style))
    members = []
    for coords in itertools.product(*(range(n) for n in mesh)):
        locals_, canon = [], {}
        for name, tensors, pl, style in exprs:
            if style == "concat_of_shards":
                per_part = tuple(p if isinstance(p, Shard) else Replicate() for p in pl)
                parts = [Sharded(Canon(t.name, t.shape), per_part, mesh, coords) for t in tensors]
                parts = [p for p in parts if 0 not in p.shape]
                expr = Concat(0, tuple(parts)) if parts else None
            else:
                base = (
                    Canon(tensors[0].name, tensors[0].shape)
                    if style == "plain"
                    else Concat(0, tuple(Canon(t.name, t.shape) for t in tensors))
                )
                expr = Sharded(base, pl, mesh, coords)
            if expr is None or 0 in expr.shape:
                continue
            locals_.append(local_tensor(name, dtype, expr))
            for t in tensors:
                canon[t.name] = replace(t, dtype=dtype)
        members.append(
            (f"{prefix}{'-'.join(map(str, coords))}", coords, Catalog(tuple(canon.values()), tuple(locals_)))
        )
    return members


def _canonical_arrays(groups, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Random normal values with a few `SPECIALS` mixed in, held as `NUMPY_DTYPES[dtype]`."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in (t for g in groups for t in g):
        values = rng.standard_normal(t.shape).astype(np.float32)
        flat = values.reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = rng.choice(SPECIALS, 3)
        out[t.name] = _torch_cast(values, "float32", dtype)
    return out


def _torch_cast(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """torch's `.to()` of `values` (held as `NUMPY_DTYPES[src]`), held as `NUMPY_DTYPES[dst]`."""
    x = torch.from_numpy(np.ascontiguousarray(values).view(np.int16) if src == "bfloat16" else values)
    x = x.view(torch.bfloat16) if src == "bfloat16" else x
    y = x.to(torch_dtype(dst))
    return y.view(torch.int16).numpy().view(np.uint16) if dst == "bfloat16" else y.numpy()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layouts_reproduce_every_destination_bit_exactly(data):
    groups = data.draw(tensor_groups())
    src_dtype, dst_dtype = data.draw(st.sampled_from(DTYPE_PAIRS))
    srcs = data.draw(side(groups, "src", src_dtype))
    dsts = data.draw(side(groups, "dst", dst_dtype))
    bucket_bytes = data.draw(st.sampled_from([4, 64, 1 << 20]))
    by_layer = data.draw(st.booleans())
    for _, _, catalog in srcs + dsts:
        catalog.validate()
    sources = [SourceMember(m, coords[0] % 2, c) for m, coords, c in srcs]
    plan = make_plan(
        sources, [DestMember(m, c, by_layer=by_layer) for m, _, c in dsts], bucket_bytes=bucket_bytes
    )
    canonical = _canonical_arrays(groups, data.draw(st.integers(0, 2**16)), src_dtype)
    src_arrays = {m: materialize(c, canonical) for m, _, c in srcs}
    dst_arrays = {m: {t.name: _sentinel(t.shape, dst_dtype) for t in c.tensors} for m, _, c in dsts}
    execute(plan, src_arrays, dst_arrays)
    cast = {name: _torch_cast(values, src_dtype, dst_dtype) for name, values in canonical.items()}
    for m, _, catalog in dsts:
        expected = materialize(catalog, cast)
        for name, arr in dst_arrays[m].items():
            np.testing.assert_array_equal(
                _bits(arr, dst_dtype), _bits(expected[name], dst_dtype), err_msg=f"{m}/{name}"
            )

    unconverted = make_plan(
        sources, [DestMember(m, _with_dtype(c, src_dtype)) for m, _, c in dsts], bucket_bytes=bucket_bytes
    )
    assert plan.total_bytes * dtype_bytes(src_dtype) == unconverted.total_bytes * dtype_bytes(dst_dtype)

    writes = {m: {t.name: np.zeros(t.shape, np.int32) for t in c.tensors} for m, _, c in dsts}
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.units) == 1
        for u in bucket.units:
            writes[bucket.dst][u.dst_tensor][u.dst_box.slices()] += 1
    for m, per_tensor in writes.items():
        for name, count in per_tensor.items():
            assert (count == 1).all(), (
                f"{m}/{name}: an element was written {count.min()}..{count.max()} times"
            )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_by_layer_destination_holds_at_most_one_bucket_of_layers_open(data):
    """A receiver that installs while it receives (the generator's inplace mode) opens a layer at
    its first byte and closes it when all of it arrived. Taking its buckets as the data plane does
    (links merged by `landing_order`, each link in index order), the layers open at once stay
    within one bucket, or within the one layer that is larger than a bucket, whatever the sources'
    layout. Layers here are the tensor groups (local tensors g<k>.*)."""
    groups = data.draw(tensor_groups())
    srcs = data.draw(side(groups, "src"))
    dsts = data.draw(side(groups, "dst"))
    bucket_bytes = data.draw(st.sampled_from([16, 64, 256, 1 << 20]))
    sources = [SourceMember(m, 0, c) for m, _, c in srcs]
    plan = make_plan(
        sources, [DestMember(m, c, by_layer=True) for m, _, c in dsts], bucket_bytes=bucket_bytes
    )
    for m, _, catalog in dsts:
        layer_bytes: dict[str, int] = defaultdict(int)
        for t in catalog.tensors:
            layer_bytes[owning_layer(t.name)] += t.nbytes
        remaining = dict(layer_bytes)
        into = sorted((b for b in plan.buckets if b.dst == m), key=lambda b: (b.src, b.index))
        open_bytes = peak = 0
        for bucket in interleaved(into, landing_order(catalog)):
            for u in bucket.units:
                layer = owning_layer(u.dst_tensor)
                if remaining[layer] == layer_bytes[layer]:
                    open_bytes += layer_bytes[layer]
                    peak = max(peak, open_bytes)
                remaining[layer] -= u.nbytes
                if remaining[layer] == 0:
                    open_bytes -= layer_bytes[layer]
        assert not any(remaining.values()), remaining
        assert peak <= max([bucket_bytes, *layer_bytes.values()]), (m, peak, dict(layer_bytes))


@settings(max_examples=60, deadline=None)
@given(groups=tensor_groups(), replicas=st.integers(2, 4), data=st.data())
def test_replicated_sources_send_once_and_spread_the_load(groups, replicas, data):
    full = Catalog(
        tuple(t for g in groups for t in g),
        tuple(local_tensor(t.name, "float32", Canon(t.name, t.shape)) for g in groups for t in g),
    )
    srcs = [SourceMember(f"src{r}", 0, full) for r in range(replicas)]
    dsts = data.draw(side(groups, "dst"))
    plan = make_plan(srcs, [DestMember(m, c) for m, _, c in dsts], bucket_bytes=1 << 30)
    needed = sum(c.nbytes for _, _, c in dsts)
    assert plan.total_bytes == needed, "replicated data must be sent exactly once per destination"
    load = defaultdict(int)
    for b in plan.buckets:
        load[b.src] += b.nbytes
    largest_unit = max(u.nbytes for b in plan.buckets for u in b.units)
    loads = [load[s.member_id] for s in srcs]
    assert max(loads) - min(loads) <= largest_unit, loads


def _sentinel(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Every byte 0x7B (a large finite number in every dtype, never drawn), so that an element
    no unit wrote fails the comparison."""
    return (
        np.full(int(np.prod(shape)) * dtype_bytes(dtype), 0x7B, np.uint8)
        .view(NUMPY_DTYPES[dtype])
        .reshape(shape)
    )


def _bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bit patterns of `values`, every NaN as one pattern: a NaN's payload bits are not
    specified by the casts (torch's CPU and CUDA casts differ there), everything else is."""
    bits = values.view(np.uint16 if dtype_bytes(dtype) == 2 else np.uint32).copy()
    nan = (bits & 0x7FFF) > 0x7F80 if dtype == "bfloat16" else np.isnan(values)
    bits[nan] = np.iinfo(bits.dtype).max
    return bits


def _with_dtype(catalog: Catalog, dtype: str) -> Catalog:
    return Catalog(
        tuple(replace(c, dtype=dtype) for c in catalog.canonical),
        tuple(replace(t, dtype=dtype) for t in catalog.tensors),
    )
