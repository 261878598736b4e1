"""Fan-out plans (`syncd.plan.fanout`): random layouts, R replicas per layout, random fan-out in;
every destination bit-exact through the NumPy data plane (relays forward the bytes they received),
every element written once, and the sources' egress that of one replica per layout."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncd.commands import checksum_key
from syncd.daemon.checks import checksum_mismatch
from syncd.daemon.plan_cache import stage_membership
from syncd.daemon.survivors import stall_timeouts
from syncd.layout import Canon, CanonicalTensor, Catalog, Shard, Sharded, local_tensor
from syncd.plan import DestMember, SourceMember, make_fanout_plan, make_plan, replica_sets
from syncd.plan.fanout import relay_depths, relay_parent
from syncd.plan.simulate import execute, materialize
from tests.unit.test_planner_properties import (
    DTYPE_PAIRS,
    _bits,
    _canonical_arrays,
    _sentinel,
    _torch_cast,
    side,
    tensor_groups,
)


@st.composite
def fanout_case(draw):
    """Sources, and destinations of one or two layouts with 1-5 replicas each, in a shuffled order."""
    groups = draw(tensor_groups())
    src_dtype, dst_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    srcs = draw(side(groups, "src", src_dtype))
    layouts = [draw(side(groups, f"dst{k}-", dst_dtype)) for k in range(draw(st.integers(1, 2)))]
    dests = []
    for k, layout in enumerate(layouts):
        for r in range(draw(st.integers(1, 5))):
            dests += [(f"gen{k}-r{r}-{m}", c) for m, _, c in layout]
    dests = draw(st.permutations(dests))
    return groups, src_dtype, dst_dtype, srcs, layouts, dests


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=fanout_case(),
    fanout=st.integers(1, 3),
    bucket_bytes=st.sampled_from([4, 64, 1 << 20]),
    data=st.data(),
)
def test_relayed_plans_deliver_every_byte_once_and_the_sources_send_one_copy(
    case, fanout, bucket_bytes, data
):
    groups, src_dtype, dst_dtype, srcs, _, dests = case
    sources = [SourceMember(m, coords[0] % 2, c) for m, coords, c in srcs]
    destinations = [DestMember(m, c) for m, c in dests]
    plan = make_fanout_plan(sources, destinations, bucket_bytes=bucket_bytes, fanout=fanout)

    canonical = _canonical_arrays(groups, data.draw(st.integers(0, 2**16)), src_dtype)
    src_arrays = {m: materialize(c, canonical) for m, _, c in srcs}
    dst_arrays = {m: {t.name: _sentinel(t.shape, dst_dtype) for t in c.tensors} for m, c in dests}
    execute(plan, src_arrays, dst_arrays)
    cast = {name: _torch_cast(values, src_dtype, dst_dtype) for name, values in canonical.items()}
    writes = {m: {t.name: np.zeros(t.shape, np.int32) for t in c.tensors} for m, c in dests}
    for b in plan.buckets:
        for u in b.units:
            writes[b.dst][u.dst_tensor][u.dst_box.slices()] += 1
    for m, catalog in dests:
        expected = materialize(catalog, cast)
        for name, arr in dst_arrays[m].items():
            np.testing.assert_array_equal(
                _bits(arr, dst_dtype), _bits(expected[name], dst_dtype), f"{m}/{name}"
            )
            assert (writes[m][name] == 1).all(), (
                f"{m}/{name} written {writes[m][name].min()}..{writes[m][name].max()}x"
            )

    # The sources send what one replica of each layout needs, member by member, whatever R is.
    heads = [s[0] for s in replica_sets(destinations)]
    one_copy = make_plan(sources, heads, bucket_bytes=bucket_bytes)
    egress = Counter()
    for b in plan.buckets:
        if b.relay is None:
            egress[b.src] += b.nbytes
    assert egress == _egress(one_copy)
    assert plan.source_bytes == one_copy.total_bytes
    assert len(heads) == len({c.content_hash for _, c in dests})  # one head per distinct layout
    _check_relay_tree(plan, destinations, fanout)


def _egress(plan) -> Counter:
    out: Counter = Counter()
    for b in plan.buckets:
        out[b.src] += b.nbytes
    return out


def _check_relay_tree(plan, destinations, fanout: int) -> None:
    """Relays run only inside a replica set, each member receives from one relay parent at most,
    a relay feeds at most `fanout` members, and every relay bucket forwards a bucket its sender
    received, with the same stage, units and bytes, and the same origin."""
    by_key = {b.key: b for b in plan.buckets}
    catalogs = {d.member_id: d.catalog for d in destinations}
    parents: dict[str, set[str]] = defaultdict(set)
    children: dict[str, set[str]] = defaultdict(set)
    for b in plan.buckets:
        if b.relay is None:
            continue
        assert catalogs[b.src] == catalogs[b.dst], f"relay {b.key} joins two layouts"
        forwarded = by_key[b.relay.forwards]
        assert forwarded.dst == b.src and forwarded.stage == b.stage
        assert forwarded.units == b.units and forwarded.nbytes == b.nbytes
        assert forwarded.origin == b.relay.origin and b.relay.origin not in catalogs
        parents[b.dst].add(b.src)
        children[b.src].add(b.dst)
    assert all(len(p) == 1 for p in parents.values()), parents
    assert all(len(c) <= fanout for c in children.values()), children
    for d in plan.buckets:  # a relayed member receives nothing from the sources
        if d.relay is None:
            assert d.dst not in parents


def test_a_chain_of_four_replicas_and_its_checksums():
    """Four TP-1 replicas in a chain: trainer -> r0 -> r1 -> r2 -> r3; every receiver's checksums
    are compared with the trainer's (the original sender), never with its relay's."""
    w = CanonicalTensor("w", (8, 4), "float32")
    catalog = Catalog((w,), (local_tensor("w", "float32", Canon(w.name, w.shape)),))
    plan = make_fanout_plan(
        [SourceMember("trainer-0", 0, catalog)],
        [DestMember(f"generator-{r}-0", catalog) for r in range(4)],
        bucket_bytes=32,
        fanout=1,
    )
    links = {(k.src, k.dst): k.relay for k in plan.links()}
    assert links == {
        ("trainer-0", "generator-0-0"): False,
        ("generator-0-0", "generator-1-0"): True,
        ("generator-1-0", "generator-2-0"): True,
        ("generator-2-0", "generator-3-0"): True,
    }
    assert plan.source_bytes == 128 and plan.relay_bytes == 3 * 128 and plan.total_bytes == 4 * 128
    assert stage_membership(plan) == {
        0: ("trainer-0", "generator-0-0", "generator-1-0", "generator-2-0", "generator-3-0")
    }

    keys = [checksum_key(u.canonical, u.canon) for b in plan.buckets if b.relay is None for u in b.units]
    good = {m: {k: f"sum-{k}" for k in keys} for m in ["trainer-0"] + [f"generator-{r}-0" for r in range(4)]}
    assert checksum_mismatch(plan, good) is None
    # A relay that reports other sums than it forwarded does not matter: only what each receiver
    # holds, against the trainer's.
    relay_lies = {**good, "generator-1-0": dict.fromkeys(keys, "other")}
    assert "receiver generator-1-0" in checksum_mismatch(plan, relay_lies)
    bad_tail = {**good, "generator-3-0": {**good["generator-3-0"], keys[0]: "flipped"}}
    problem = checksum_mismatch(plan, bad_tail)
    assert "sender trainer-0" in problem and "receiver generator-3-0" in problem


def test_layouts_get_their_own_distribution_and_in_place_receivers_are_not_relays():
    w = CanonicalTensor("w", (8, 4), "float32")
    whole = Catalog((w,), (local_tensor("w", "float32", Canon(w.name, w.shape)),))
    half = [
        Catalog(
            (w,), (local_tensor("w", "float32", Sharded(Canon(w.name, w.shape), (Shard(0),), (2,), (t,))),)
        )
        for t in range(2)
    ]
    dests = [DestMember("a-0-0", whole), DestMember("b-0-0", half[0]), DestMember("b-0-1", half[1])]
    dests += [DestMember("a-1-0", whole), DestMember("b-1-0", half[0]), DestMember("b-1-1", half[1])]
    dests += [DestMember("c-0-0", whole, by_layer=True), DestMember("c-1-0", whole, by_layer=True)]
    sets = [[d.member_id for d in s] for s in replica_sets(dests)]
    assert sets == [["a-0-0", "a-1-0"], ["b-0-0", "b-1-0"], ["b-0-1", "b-1-1"], ["c-0-0"], ["c-1-0"]]
    plan = make_fanout_plan([SourceMember("t", 0, whole)], dests, bucket_bytes=16)
    relays = sorted((k.src, k.dst) for k in plan.links() if k.relay)
    assert relays == [("a-0-0", "a-1-0"), ("b-0-0", "b-1-0"), ("b-0-1", "b-1-1")]
    with pytest.raises(ValueError, match="fanout must be at least 1"):
        make_fanout_plan([SourceMember("t", 0, whole)], dests, fanout=0)


@pytest.mark.parametrize(
    "fanout, expected", [(1, [0, 1, 2, 3, 4]), (2, [0, 0, 1, 1, 2]), (3, [0, 0, 0, 1, 1])]
)
def test_relay_parents(fanout, expected):
    assert [relay_parent(p, fanout) for p in range(1, 6)] == expected


def test_the_member_starving_behind_a_stuck_relay_gives_up_first():
    """Stall timeouts grow with the hops from the trainers, so that of every member starving
    behind a stuck relay, its own successor (which receives from it) gives up first, naming it."""
    w = CanonicalTensor("w", (8, 4), "float32")
    catalog = Catalog((w,), (local_tensor("w", "float32", Canon(w.name, w.shape)),))
    plan = make_fanout_plan(
        [SourceMember("trainer-0", 0, catalog)],
        [DestMember(f"generator-{r}-0", catalog) for r in range(4)],
        bucket_bytes=32,
    )
    assert relay_depths(plan) == {
        "trainer-0": 0,
        "generator-0-0": 1,
        "generator-1-0": 2,
        "generator-2-0": 3,
        "generator-3-0": 4,
    }
    stalls = stall_timeouts(plan, 10.0)
    order = sorted(stalls, key=stalls.get)
    assert order == ["trainer-0", "generator-0-0", "generator-1-0", "generator-2-0", "generator-3-0"]
    assert max(stalls.values()) < 2 * min(stalls.values())  # sends (twice) wait longer than any receive
