"""Delta links on the gloo data plane: after a delta the receivers hold exactly what a full refit
would have given them, checksums cover whole regions (so a receiver on the wrong base is caught),
few bytes move when few elements change, and a step that changes everything goes dense."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from syncd.commands import DeltaLinks
from syncd.layout import (
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    Replicate,
    Shard,
    Sharded,
    Stack,
    local_tensor,
)
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import GlooTransport, LoopOptions, catalog_views, recv_buckets
from syncd.member.dataplane.delta import Diffs, Mirror, recv_with_deltas, send_with_deltas
from syncd.member.dataplane.delta.compare import (
    _SAMPLE,
    _SAMPLE_RUN,
    _changed_positions,
    _sample_mostly_changed,
    _sample_runs,
)
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import _run_threads

E, I, H = 4, 64, 48
GATE = CanonicalTensor("m.experts.gate_proj.weight", (E, I, H), "float32")
UP = CanonicalTensor("m.experts.up_proj.weight", (E, I, H), "float32")
NORM = CanonicalTensor("m.norm.weight", (H,), "float32")
ALL = (GATE, UP, NORM)
DELTA_ALL = {"gen-a", "gen-b0", "gen-b1"}
_GROUPS = itertools.count()


def trainer_catalog(ep_rank: int, tp_rank: int) -> Catalog:
    fused = Stack(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape)))
    return Catalog(
        ALL,
        (
            local_tensor("w13", "float32", Sharded(fused, (Shard(0), Shard(2)), (2, 2), (ep_rank, tp_rank))),
            local_tensor("norm", "float32", Canon(NORM.name, NORM.shape)),
        ),
    )


def vllm_catalog(tp_rank: int, tp: int, dtype: str) -> Catalog:
    parts = tuple(Sharded(Canon(c.name, c.shape), (Shard(1),), (tp,), (tp_rank,)) for c in (GATE, UP))
    return Catalog(
        tuple(replace(c, dtype=dtype) for c in ALL),
        (
            local_tensor("w13_weight", dtype, Concat(1, parts)),
            local_tensor(
                "norm", dtype, Sharded(Canon(NORM.name, NORM.shape), (Replicate(),), (tp,), (tp_rank,))
            ),
        ),
    )


class Refits:
    """Four trainer ranks (ep 2 x tp 2, float32) and generators at TP 1 and TP 2 in `dtype`; each
    `refit` runs one transfer over a fresh gloo group, the senders keeping their mirrors."""

    def __init__(self, dtype: str, bucket_bytes: int = 16 << 10) -> None:
        self.dtype = dtype
        self.sources = [
            SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
        ]
        self.dests = [DestMember("gen-a", vllm_catalog(0, 1, dtype))] + [
            DestMember(f"gen-b{t}", vllm_catalog(t, 2, dtype)) for t in range(2)
        ]
        self.plan = make_plan(self.sources, self.dests, bucket_bytes=bucket_bytes)
        self.mirrors = {s.member_id: Mirror() for s in self.sources}
        rng = np.random.default_rng(0)
        self.canonical = {c.name: (rng.standard_normal(c.shape) * 0.02).astype(np.float32) for c in ALL}
        wire = torch_dtype(dtype)
        self.received = {
            d.member_id: {t.name: torch.zeros(t.shape, dtype=wire) for t in d.catalog.tensors}
            for d in self.dests
        }

    def expected(self, member_id: str) -> dict[str, torch.Tensor]:
        d = next(d for d in self.dests if d.member_id == member_id)
        return {
            k: torch.from_numpy(v).to(torch_dtype(self.dtype))
            for k, v in materialize(d.catalog, self.canonical).items()
        }

    def refit(
        self, delta_dsts: set[str], base: int | None = None, max_fraction: float = 0.5, commit: bool = True
    ):
        """`commit` False: the senders' transfers succeed but their agents never commit the
        mirrors (the refit failed before, as when a receiver or another stage fails)."""
        members = [m.member_id for m in self.sources + self.dests]
        ranks = {m: i for i, m in enumerate(members)}
        address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
        group, stats = f"delta{next(_GROUPS)}", {}
        local = {
            s.member_id: {
                k: torch.from_numpy(v.copy()) for k, v in materialize(s.catalog, self.canonical).items()
            }
            for s in self.sources
        }

        def member(m, catalog, sending):
            transport = GlooTransport.connect(
                address, ranks[m], len(members), group, 30, store if ranks[m] == 0 else None
            )
            try:
                views = catalog_views(catalog, local[m] if sending else self.received[m])
                if sending:
                    links, diffs = (
                        DeltaLinks(base, frozenset(delta_dsts), max_fraction),
                        Diffs(self.mirrors[m]),
                    )
                    stats[m] = send_with_deltas(
                        self.plan.for_member(m), views, transport, ranks, links, diffs, LoopOptions(30)
                    )
                    if commit:
                        diffs.commit(views)  # as the agent does once all its stages succeeded
                elif m in delta_dsts:
                    links = DeltaLinks(base, frozenset(delta_dsts), max_fraction)
                    stats[m] = recv_with_deltas(
                        self.plan.for_member(m), views, transport, ranks, links, LoopOptions(30)
                    )
                else:
                    stats[m] = recv_buckets(self.plan.for_member(m), views, transport, ranks, LoopOptions(30))
            finally:
                transport.close()

        errors = _run_threads(
            [lambda s=s: member(s.member_id, s.catalog, True) for s in self.sources]
            + [lambda d=d: member(d.member_id, d.catalog, False) for d in self.dests]
        )
        assert not errors, errors
        return stats

    def assert_exact(self) -> None:
        """Every generator holds exactly the current version."""
        for d in self.dests:
            expected = self.expected(d.member_id)
            for name, t in self.received[d.member_id].items():
                assert torch.equal(t, expected[name]), (d.member_id, name)

    def assert_mirrors_hold_the_new_version(self, canonical: dict[str, np.ndarray] | None = None) -> None:
        """Each sender's mirror, where it says it holds what it sent (whole tensors, regions),
        equals its tensors of the current version (or of `canonical`) in the generators' dtype."""
        checked = 0
        for s in self.sources:
            mirror = self.mirrors[s.member_id]
            new = {
                k: torch.from_numpy(v).to(torch_dtype(self.dtype))
                for k, v in materialize(s.catalog, canonical or self.canonical).items()
            }
            for name, dtype in mirror.whole:
                assert torch.equal(mirror.tensor(name, dtype, new[name]), new[name]), (s.member_id, name)
                checked += 1
            for name, box, dtype in mirror.held:
                held = mirror.tensor(name, dtype, new[name])[box.slices()]
                assert torch.equal(held, new[name][box.slices()]), (s.member_id, name, box)
        assert checked >= len(self.sources)  # each sent its expert tensor whole to gen-a

    def next_delta_exact(self, base: int) -> dict:
        """An RL-like step, then its delta refit on `base`: every generator ends exact."""
        self.step(0.01, size=0.05)
        stats = self.refit(DELTA_ALL, base=base)
        assert self.checksums_agree(stats)
        self.assert_exact()
        return stats

    def checksums_agree(self, stats) -> bool:
        sent = {k: v for s in self.sources for k, v in stats[s.member_id].checksums.items()}
        return all(sent[k] == v for d in self.dests for k, v in stats[d.member_id].checksums.items())

    def step(self, fraction: float, size: float = 1e-6) -> None:
        """An optimizer-like step: `fraction` of each tensor's elements move by about `size`."""
        rng = np.random.default_rng(len(self.canonical) + int(fraction * 1e6))
        for v in self.canonical.values():
            hit = rng.random(v.shape) < fraction
            v[hit] += np.float32(size) * np.sign(rng.standard_normal(hit.sum())).astype(np.float32) + v[
                hit
            ] * np.float32(size)


@pytest.mark.parametrize(
    "dtype, fraction",
    [("float32", 0.01), ("bfloat16", 0.01), ("bfloat16", 0.1)],
    ids=["float32", "bfloat16", "bfloat16-10pct"],
)
def test_delta_refit_equals_full_and_moves_few_bytes(dtype, fraction):
    """Version 1 goes full (the mirrors fill), version 2 goes as deltas to the TP-2 generator and
    full to the TP-1 one in the same transfer: both end bit-exact, checksums of whole regions agree,
    and the delta link moves a small fraction of its full bytes. (At 10% each unit compares its
    own region instead of locating its tensor's changed positions.)"""
    r = Refits(dtype)
    first = r.refit(set())
    assert r.checksums_agree(first)
    r.step(fraction, size=0.05)  # big enough that bf16 rounding keeps the changes
    second = r.refit({"gen-b0", "gen-b1"}, base=1)
    assert r.checksums_agree(second)
    for d in r.dests:
        for name, t in r.received[d.member_id].items():
            assert torch.equal(t, r.expected(d.member_id)[name]), (d.member_id, name)
    full = {m: first[m].bytes for m in ("gen-b0", "gen-b1")}
    moved = {m: second[m].bytes for m in ("gen-b0", "gen-b1")}
    assert all(moved[m] < 6 * fraction * full[m] for m in moved), (moved, full)  # 4 + 2 bytes per change
    assert second["gen-a"].bytes == first["gen-a"].bytes  # the full link is unchanged
    b0 = second["gen-b0"]
    assert (
        0.5 * fraction * b0.elements < b0.changed < 2 * fraction * b0.elements
        and b0.elements == r.dests[1].catalog.nbytes // torch_dtype(dtype).itemsize
    )


def test_a_step_that_changes_everything_goes_dense_and_stays_exact():
    """Every bucket goes dense (the expert tensors found changed from a sample of them); the
    mirrors take the dense regions after the transfer and equal the new version, so the next
    RL-like step's delta is exact and small."""
    r = Refits("bfloat16")
    first = r.refit(set())
    r.step(1.0, size=0.05)
    second = r.refit(DELTA_ALL, base=1)
    assert r.checksums_agree(second)
    for d in r.dests:
        assert (
            second[d.member_id].bytes == first[d.member_id].bytes
        )  # every bucket dense: no header bytes counted
    r.assert_exact()
    r.assert_mirrors_hold_the_new_version()
    third = r.next_delta_exact(base=2)
    assert all(third[m].bytes < 0.06 * first[m].bytes for m in DELTA_ALL)


def test_a_link_dense_by_its_samples_sends_its_small_tensors_uncompared_and_stays_exact():
    """Every expert element changes, the norm does not: the links whose buckets the expert
    samples settle go dense whole without comparing the norm, which goes dense with them and is
    counted changed (gen-a takes it in a bucket with expert rows). Every generator ends exact,
    the mirrors take the norm whole, and the next RL-like step's delta is exact."""
    r = Refits("bfloat16")
    r.refit(set())
    for name in (GATE.name, UP.name):
        r.canonical[name] += np.float32(0.05)
    second = r.refit(DELTA_ALL, base=1)
    assert r.checksums_agree(second)
    assert second["gen-a"].changed == second["gen-a"].elements  # the unchanged norm included
    r.assert_exact()
    r.assert_mirrors_hold_the_new_version()
    r.next_delta_exact(base=2)


def test_a_dense_refit_that_fails_leaves_the_mirrors_on_the_base():
    """A step that changes everything goes dense, but the refit fails after the transfers (the
    senders never commit): the mirrors still hold version 1 bit for bit (nothing was written into
    them during the transfer), so a delta on base 1 after it is exact."""
    r = Refits("bfloat16")
    r.refit(set())
    base = {k: v.copy() for k, v in r.canonical.items()}
    r.step(1.0, size=0.05)
    r.refit(DELTA_ALL, base=1, commit=False)
    r.assert_mirrors_hold_the_new_version(base)
    for d in r.dests:  # the generators drop what they staged and keep version 1
        r.received[d.member_id].update(
            {k: torch.from_numpy(v).to(torch_dtype(r.dtype)) for k, v in materialize(d.catalog, base).items()}
        )
    second = r.refit(DELTA_ALL, base=1)
    assert r.checksums_agree(second)
    r.assert_exact()
    r.assert_mirrors_hold_the_new_version()


def test_a_tensor_whose_sample_looks_changed_goes_dense_and_the_next_delta_is_exact():
    """Only the elements `_sample_mostly_changed` looks at change in trainer-0's w13 (a sixth of
    them, where the exact comparison would send a delta): it goes dense on the sample's word,
    every generator ends exact, and the delta after it is exact."""
    r = Refits("float32")
    r.refit(set())
    trainer = r.sources[0]
    before = materialize(trainer.catalog, r.canonical)["w13"]
    shape = before.shape  # (E / ep, 2, I, H / tp): trainer-0 holds experts [0, E/2), columns [0, H/2)
    first, step = _sample_runs(before.size)
    for p in (first + run * step + k for run in range(_SAMPLE // _SAMPLE_RUN) for k in range(_SAMPLE_RUN)):
        e, part, i, h = np.unravel_index(p, shape)
        r.canonical[(GATE, UP)[part].name][e, i, h] += np.float32(0.05)
    old, new = torch.from_numpy(before), torch.from_numpy(materialize(trainer.catalog, r.canonical)["w13"])
    assert _sample_mostly_changed(new, old) and _changed_positions(new, old, give_up=True) is not None
    second = r.refit(DELTA_ALL, base=1)
    assert r.checksums_agree(second)
    assert second[trainer.member_id].changed > 0.9 * second[trainer.member_id].elements  # went dense
    r.assert_exact()
    r.assert_mirrors_hold_the_new_version()
    r.step(0.01, size=0.05)
    third = r.refit(DELTA_ALL, base=2)
    assert r.checksums_agree(third)
    r.assert_exact()


def test_a_receiver_on_another_base_fails_the_whole_region_checksum():
    """One element of a receiver's base flipped by hand: the delta applies, and the checksum of
    the whole region (not only of the delta) differs from the sender's."""
    r = Refits("bfloat16")
    r.refit(set())
    r.step(0.01, size=0.05)
    r.received["gen-a"]["w13_weight"].view(-1)[12345] += 1.0
    second = r.refit({"gen-a"}, base=1)
    assert not r.checksums_agree(second)
    sent = {k: v for s in r.sources for k, v in second[s.member_id].checksums.items()}
    bad = [k for k, v in second["gen-a"].checksums.items() if sent[k] != v]
    assert len(bad) == 1 and bad[0].startswith(("m.experts.gate_proj.weight", "m.experts.up_proj.weight"))


def test_unchanged_weights_move_only_headers():
    r = Refits("float32")
    r.refit(set())
    second = r.refit({"gen-a", "gen-b0", "gen-b1"}, base=1)
    assert r.checksums_agree(second)
    assert all(second[d.member_id].bytes == 0 and second[d.member_id].changed == 0 for d in r.dests)
    assert all(not second[d.member_id].touched for d in r.dests)


def test_box_runs_list_the_flat_positions_of_a_box_in_its_own_order():
    """What a unit's delta is cut from: every box of random 1- to 4-d tensors as contiguous runs."""
    from syncd.layout import Box
    from syncd.member.dataplane.delta.scatter import _box_runs

    rng = np.random.default_rng(3)
    for _ in range(300):
        shape = tuple(int(x) for x in rng.integers(1, 5, size=rng.integers(1, 5)))
        start = tuple(int(rng.integers(0, n)) for n in shape)
        stop = tuple(int(rng.integers(a + 1, n + 1)) for a, n in zip(start, shape))
        box = Box(start, stop)
        starts, run = _box_runs(shape, box)
        listed = (starts[:, None] + torch.arange(run)[None, :]).reshape(-1)
        expected = torch.arange(int(np.prod(shape))).view(shape)[box.slices()].reshape(-1)
        assert torch.equal(listed, expected), (shape, box)


@pytest.mark.parametrize("many_runs", [False, True])
def test_a_scatter_into_a_box_writes_its_positions_and_nothing_else(many_runs):
    """`_scatter_box`, a delta's write into its region of a tensor: ascending positions in the box's
    C order, into boxes of few runs (numpy, run by run) and of many (one `index_copy_`)."""
    from syncd.layout import Box
    from syncd.member.dataplane.delta.scatter import _FEW_RUNS, _box_runs, _scatter_box

    rng = np.random.default_rng(4)
    for _ in range(100):
        shape = (int(rng.integers(_FEW_RUNS + 1, 2 * _FEW_RUNS)), 3, 5) if many_runs else (6, 4, 7)
        start = tuple(int(rng.integers(0, n)) for n in shape)
        stop = tuple(int(rng.integers(a + 1, n + 1)) for a, n in zip(start, shape))
        if many_runs:  # part of the middle dim of every row: a run per row
            middle = int(rng.integers(0, 2))
            start, stop = (0, middle, 0), (shape[0], int(rng.integers(middle + 1, 3)), shape[2])
        box = Box(start, stop)
        parent = torch.randn(shape).to(torch.bfloat16)
        expected = parent.clone()
        numel = box.numel
        index = torch.from_numpy(
            np.sort(rng.choice(numel, size=int(rng.integers(1, numel + 1)), replace=False))
        )
        values = torch.randn(index.numel()).to(torch.bfloat16)
        region = expected[box.slices()].clone().reshape(-1)
        region[index.long()] = values
        expected[box.slices()] = region.view(expected[box.slices()].shape)
        _scatter_box(parent, box, parent[box.slices()], index.to(torch.int32), values)
        assert torch.equal(parent.view(torch.int16), expected.view(torch.int16)), (shape, box)
        assert (len(_box_runs(shape, box)[0]) > _FEW_RUNS) == many_runs, (shape, box)
