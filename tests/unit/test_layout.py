"""The layout language: placements produce the right boxes; bad catalogs fail loud."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from syncd.layout import (
    Box,
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    InterleavedShard,
    LocalTensor,
    Piece,
    Replicate,
    Shard,
    Sharded,
    local_tensor,
    split_range,
)
from syncd.layout.hf_names import canonical_shapes_from_hf, group_from_hf, split_to_hf
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize

E, I, H = 4, 6, 3  # experts, expert intermediate size, hidden size
GATE = CanonicalTensor("model.layers.0.mlp.experts.gate_proj.weight", (E, I, H), "float32")
UP = CanonicalTensor("model.layers.0.mlp.experts.up_proj.weight", (E, I, H), "float32")


@pytest.mark.parametrize(
    "size, parts, expected",
    [(10, 2, [(0, 5), (5, 10)]), (10, 3, [(0, 4), (4, 7), (7, 10)]), (2, 3, [(0, 1), (1, 2), (2, 2)])],
)
def test_split_range_is_array_split(size, parts, expected):
    assert [split_range(size, parts, i) for i in range(parts)] == expected


def _canonical_arrays():
    rng = np.random.default_rng(0)
    return {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in (GATE, UP)}


def test_expert_tp_interleaved_fused_weight_keeps_same_half_of_every_expert_projection():
    """Trainer layout: experts sharded over ep=2, the fused [E_l*2*I, H] gate/up weight split
    with InterleavedShard over tp=2."""
    arrays = _canonical_arrays()
    for ep in range(2):
        for tp in range(2):
            experts = range(ep * 2, ep * 2 + 2)
            fused = Concat(
                0,
                tuple(
                    Canon(c.name, c.shape, Box((e, 0, 0), (e + 1, I, H)), drop=(0,))
                    for e in experts
                    for c in (GATE, UP)
                ),
            )
            expr = Sharded(fused, (InterleavedShard(0, 4),), (2,), (tp,))
            t = local_tensor("w13", "float32", expr)
            local = materialize(Catalog((GATE, UP), (t,)), arrays)["w13"]
            rows = slice(tp * I // 2, (tp + 1) * I // 2)
            expected = np.concatenate([arrays[c.name][e, rows] for e in experts for c in (GATE, UP)])
            np.testing.assert_array_equal(local, expected)


def test_vllm_w13_is_per_expert_gate_slice_then_up_slice():
    arrays = _canonical_arrays()
    tp_rank = 1
    expr = Concat(
        1, tuple(Sharded(Canon(c.name, c.shape), (Shard(1),), (2,), (tp_rank,)) for c in (GATE, UP))
    )
    t = local_tensor("w13_weight", "float32", expr)
    assert t.shape == (E, I, H) and len(t.pieces) == 2
    local = materialize(Catalog((GATE, UP), (t,)), arrays)["w13_weight"]
    half = slice(I // 2, I)
    np.testing.assert_array_equal(
        local, np.concatenate([arrays[GATE.name][:, half], arrays[UP.name][:, half]], axis=1)
    )


def test_uneven_shard_covers_everything_once():
    c = CanonicalTensor("w", (7, 5), "float32")
    pieces = [
        local_tensor("w", "float32", Sharded(Canon("w", (7, 5)), (Shard(0), Replicate()), (3, 2), (r, 0)))
        for r in range(3)
    ]
    assert [t.shape for t in pieces] == [(3, 5), (2, 5), (2, 5)]
    Catalog(
        (c,), tuple(LocalTensor(f"w{i}", t.shape, t.dtype, t.pieces) for i, t in enumerate(pieces[:1]))
    ).validate()


def test_hf_expert_names_round_trip():
    grouped = {GATE.name: np.arange(E * I * H).reshape(E, I, H)}
    hf = dict(split_to_hf(GATE.name, grouped[GATE.name], E))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in hf
    back = group_from_hf(hf.items(), np.stack)
    np.testing.assert_array_equal(back[GATE.name], grouped[GATE.name])
    assert canonical_shapes_from_hf({k: v.shape for k, v in hf.items()}) == {GATE.name: (E, I, H)}
    with pytest.raises(ValueError, match="not numbered"):
        group_from_hf([("model.layers.0.mlp.experts.1.gate_proj.weight", 0)], np.stack)


def _catalog(*pieces: Piece, shape=(4, 4), dtype="float32", canon_shape=(4, 4), canon_dtype="float32"):
    return Catalog(
        (CanonicalTensor("w", canon_shape, canon_dtype),), (LocalTensor("t", shape, dtype, pieces),)
    )


FULL = Box((0, 0), (4, 4))
TOP, BOTTOM = Box((0, 0), (2, 4)), Box((2, 0), (4, 4))


@pytest.mark.parametrize(
    "catalog, match",
    [
        (_catalog(Piece("w", FULL, FULL), dtype="float31", canon_dtype="float31"), "unknown dtype 'float31'"),
        (
            _catalog(Piece("w", Box((0, 0), (4, 5)), Box((0, 0), (4, 5))), shape=(4, 5)),
            r"outside canonical tensor w",
        ),
        (_catalog(Piece("w", TOP, TOP), Piece("w", BOTTOM, Box((1, 0), (3, 4)))), "overlap"),
        (_catalog(Piece("w", TOP, TOP)), "cover 8 of its 16 elements"),
        (
            _catalog(Piece("w", FULL, FULL), canon_dtype="bfloat16"),
            "is float32 but its canonical w is bfloat16",
        ),
        (_catalog(Piece("v", FULL, FULL)), "canonical tensor v is not declared"),
    ],
)
def test_bad_catalogs_fail_loud(catalog, match):
    with pytest.raises(ValueError, match=match):
        catalog.validate()


def test_piece_extents_must_match():
    with pytest.raises(ValueError, match="same extents"):
        Piece("w", Box((0, 0), (2, 4)), Box((0, 0), (4, 2)))


def test_content_hash_dedups_identical_catalogs_only():
    a = _catalog(Piece("w", FULL, FULL))
    assert a.content_hash == _catalog(Piece("w", FULL, FULL)).content_hash
    assert a.content_hash != _catalog(Piece("w", TOP, TOP), Piece("w", BOTTOM, BOTTOM)).content_hash


def _member(catalog, i=0):
    return SourceMember(f"src{i}", 0, catalog)


@pytest.mark.parametrize(
    "src, dst, match",
    [
        (
            _catalog(Piece("w", TOP, TOP), shape=(2, 4)),
            _catalog(Piece("w", FULL, FULL)),
            r"no source covers region \[2:4, 0:4\] of canonical tensor w",
        ),
        (
            _catalog(Piece("w", FULL, FULL)),
            _catalog(Piece("w", Box((0, 0), (4, 2)), Box((0, 0), (4, 2))), shape=(4, 2), canon_shape=(4, 2)),
            "canonical tensor w disagrees",
        ),
        (
            _catalog(Piece("w", FULL, FULL)),
            _catalog(Piece("w", FULL, FULL), dtype="float8_e4m3fn", canon_dtype="float8_e4m3fn"),
            r"canonical tensor w: cannot convert float32 \(source\) to float8_e4m3fn",
        ),
    ],
)
def test_planner_fails_loud_before_any_transfer(src, dst, match):
    with pytest.raises(ValueError, match=match):
        make_plan([_member(src)], [DestMember("dst0", dst)])


def test_planner_rejects_overlapping_destination_boxes_on_one_member():
    two = Catalog(
        (CanonicalTensor("w", (4, 4), "float32"),),
        (
            LocalTensor("a", (4, 4), "float32", (Piece("w", FULL, FULL),)),
            LocalTensor("b", (2, 4), "float32", (Piece("w", TOP, TOP),)),
        ),
    )
    with pytest.raises(ValueError, match="of w overlap"):
        make_plan([_member(_catalog(Piece("w", FULL, FULL)))], [DestMember("dst0", two)])


def test_stacked_view_of_fused_expert_weight_equals_interleaved_2d_layout():
    """The trainer registers its fused gate/up weight as the view [E_l, 2, I/tp, H] (two pieces);
    it must describe the same elements as InterleavedShard on the 2-D [E_l*2*I, H] tensor."""
    from syncd.layout import Stack

    arrays = _canonical_arrays()
    for ep_rank in range(2):
        for tp_rank in range(2):
            view = Sharded(
                Stack(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape))),
                (Shard(0), Shard(2)),
                (2, 2),
                (ep_rank, tp_rank),
            )
            t4 = local_tensor("w13", "float32", view)
            assert t4.shape == (2, 2, I // 2, H) and len(t4.pieces) == 2
            fused = Concat(
                0,
                tuple(
                    Canon(c.name, c.shape, Box((e, 0, 0), (e + 1, I, H)), drop=(0,))
                    for e in range(E)
                    for c in (GATE, UP)
                ),
            )
            t2 = local_tensor(
                "w13",
                "float32",
                Sharded(fused, (Shard(0), InterleavedShard(0, 4)), (2, 2), (ep_rank, tp_rank)),
            )
            a = materialize(Catalog((GATE, UP), (t4,)), arrays)["w13"]
            b = materialize(Catalog((GATE, UP), (t2,)), arrays)["w13"]
            np.testing.assert_array_equal(a.reshape(b.shape), b)


def test_a_box_knows_its_shape_and_size_and_is_equal_by_its_ranges_only():
    """`shape` and `numel` are computed once, when the box is made (the data plane asks them of
    every unit on every refit), and take no part in equality, hashing or pickling's round trip."""
    box = Box((0, 2, 4), (3, 5, 9))
    assert box.shape == (3, 3, 5) and box.numel == 45
    same = pickle.loads(pickle.dumps(box))
    assert same == box and hash(same) == hash(box) and same.numel == 45
    assert dataclasses.replace(box, stop=(3, 5, 10)).shape == (3, 3, 6)
    assert box.intersect(Box((1, 0, 0), (9, 9, 9))).shape == (2, 3, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        box.numel = 1  # type: ignore[misc]
