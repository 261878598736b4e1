"""Muon's communication planning (pure): which path a batch takes, and that the all-to-all
exchanges of every rank fit together and bring each matrix whole to exactly one owner and every
piece of every result back to each rank that holds it."""

from __future__ import annotations

import pytest

from trainer_svc.optim.muon_plan import (
    ALL_GATHER,
    ALL_TO_ALL,
    BATCHED,
    LOCAL,
    BatchLayout,
    choose_path,
    gather_to_owners,
    owners,
    scatter_from_owners,
)


def _layout(matrices: int, tp: int, replicas: int, shard_dim: int = 0) -> BatchLayout:
    return BatchLayout(tuple((8 * (1 + m % 3), 16) for m in range(matrices)), shard_dim, tp, replicas)


@pytest.mark.parametrize(
    "matrices,tp,replicas,path",
    [
        (8, 1, 1, LOCAL),  # experts with ep only: whole matrices on every rank
        (1, 1, 4, LOCAL),  # one o_proj replicated over dp x ep, no tp: nothing to share
        (8, 1, 2, ALL_TO_ALL),  # experts replicated over dp=2: the replicas split the NS work
        (8, 2, 1, ALL_TO_ALL),  # 4 local experts' gate+up over tp=2
        (16, 4, 1, ALL_TO_ALL),
        (4, 2, 2, ALL_TO_ALL),  # M == G: one matrix per rank
        (1, 2, 1, ALL_GATHER),  # o_proj over tp=2
        (2, 4, 1, ALL_GATHER),  # tp a multiple of the local experts
        (1, 2, 4, ALL_GATHER),
        (3, 2, 1, BATCHED),  # q, k, v over tp=2
        (3, 1, 2, BATCHED),  # q, k, v replicated over ep=2 only
        (3, 2, 4, BATCHED),
        (6, 4, 1, BATCHED),
    ],
)
def test_path_by_divisibility(matrices, tp, replicas, path):
    assert choose_path(_layout(matrices, tp, replicas)) == path


def test_layout_refuses_a_matrix_tp_cannot_split():
    with pytest.raises(ValueError, match=r"\(6, 16\) dim 0 is not divisible by tp 4"):
        BatchLayout(((6, 16),), 0, 4, 1)
    with pytest.raises(ValueError, match="shard_dim must be 0 or 1"):
        BatchLayout(((8, 16),), 2, 1, 1)


def _simulate(layout: BatchLayout, plan_for, have: list[dict]) -> list[dict]:
    """Run one exchange for all ranks of the work group; check both sides of every link agree."""
    G = layout.group_size
    plans = [plan_for(layout, g) for g in range(G)]
    out = [{} for _ in range(G)]
    for src in range(G):
        for dst in range(G):
            sent, expected = plans[src].send[dst], plans[dst].recv[src]
            assert sent == expected, (src, dst)
            for item in sent:
                assert item not in out[dst], f"{item} delivered twice to {dst}"
                out[dst][item] = have[src][item]
    return out


SHAPES = [(m, tp, r) for m in (1, 2, 3, 4, 5, 8, 16) for tp in (1, 2, 4) for r in (1, 2, 3)]


@pytest.mark.parametrize("matrices,tp,replicas", SHAPES)
def test_owners_get_whole_matrices_and_every_rank_its_pieces_back(matrices, tp, replicas):
    layout = _layout(matrices, tp, replicas, shard_dim=matrices % 2)
    G = layout.group_size
    # rank g = r * tp + t holds piece t of every matrix; replicas hold the same values
    have = [{(m, g % tp): f"m{m}p{g % tp}" for m in range(matrices)} for g in range(G)]
    at_owner = _simulate(layout, gather_to_owners, have)
    own = owners(layout)
    for g in range(G):
        mine = sorted(m for m in range(matrices) if own[m] == g)
        assert sorted(at_owner[g]) == [(m, t) for m in mine for t in range(tp)]
    counts = [own.count(g) for g in range(G)]
    assert max(counts) - min(counts) <= 1  # work shared over tp and replicas alike
    results = [
        {(m, t): f"update{m}p{t}" for m in range(matrices) if own[m] == g for t in range(tp)}
        for g in range(G)
    ]
    back = _simulate(layout, scatter_from_owners, results)
    for g in range(G):
        assert back[g] == {(m, g % tp): f"update{m}p{g % tp}" for m in range(matrices)}


@pytest.mark.parametrize("matrices,tp,replicas", [(3, 2, 2), (5, 4, 1), (16, 4, 2)])
def test_owners_send_only_what_they_lack(matrices, tp, replicas):
    """No replica outside the owner's tp row sends pieces (they hold copies), and nothing travels
    between ranks that would only carry a copy of what the receiver already has."""
    layout = _layout(matrices, tp, replicas)
    own = owners(layout)
    for g in range(layout.group_size):
        plan = gather_to_owners(layout, g)
        for dst, items in enumerate(plan.send):
            for m, piece in items:
                assert dst == own[m] and g // tp == own[m] // tp and piece == g % tp
