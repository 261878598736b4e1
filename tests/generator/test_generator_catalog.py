"""Pure tests of the catalog builder and staging (no vLLM engine)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from generator_svc.worker.catalog import (
    TP,
    ExpertsParam,
    QKVParam,
    ReplicatedParam,
    ShardedParam,
    VocabParam,
    build_catalog,
    catalog_from_json,
    catalog_to_json,
)
from generator_svc.worker.staging import Staging
from syncd.layout import Box

H, D, E, I, V = 16, 4, 4, 8, 40


def layer_specs(tp: TP, *, heads: int = 4, kv_heads: int = 2, vocab_rows: tuple[int, int] = (0, V)) -> list:
    p = "model.layers.0"
    return [
        VocabParam("model.embed_tokens.weight", "float32", "model.embed_tokens.weight", (V, H), *vocab_rows),
        QKVParam(
            f"{p}.self_attn.qkv_proj.weight",
            "float32",
            f"{p}.self_attn.q_proj.weight",
            f"{p}.self_attn.k_proj.weight",
            f"{p}.self_attn.v_proj.weight",
            H,
            D,
            heads,
            kv_heads,
            tp,
        ),
        ShardedParam(
            f"{p}.self_attn.o_proj.weight", "float32", f"{p}.self_attn.o_proj.weight", (H, heads * D), 1, tp
        ),
        ReplicatedParam(f"{p}.mlp.gate.weight", "float32", f"{p}.mlp.gate.weight", (E, H)),
        ExpertsParam(
            f"{p}.mlp.experts.routed_experts.w13_weight", "float32", "w13", f"{p}.mlp.experts", E, I, H, tp
        ),
        ExpertsParam(
            f"{p}.mlp.experts.routed_experts.w2_weight", "float32", "w2", f"{p}.mlp.experts", E, I, H, tp
        ),
        ReplicatedParam(f"{p}.input_layernorm.weight", "float32", f"{p}.input_layernorm.weight", (H,)),
    ]


def canonical_arrays(catalog, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in catalog.canonical}


def simulate(catalog, canon: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fill each local tensor from canonical arrays through the catalog's pieces (NaN = uncovered)."""
    out = {}
    for t in catalog.tensors:
        a = np.full(t.shape, np.nan, dtype=np.float32)
        for p in t.pieces:
            a[p.local.slices()] = canon[p.canonical][p.canon.slices()].reshape(p.local.shape)
        out[t.name] = a
    return out


def vllm_rank_view(canon: dict[str, np.ndarray], tp: TP, kv_heads: int) -> dict[str, np.ndarray]:
    """Independent reference: what vLLM's loaders put in each parameter on rank `tp.rank`."""
    p = "model.layers.0"
    q, k, v = (canon[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv")
    qs = q.shape[0] // tp.size
    kv_rank = tp.rank // max(1, tp.size // kv_heads)
    ks = k.shape[0] // min(tp.size, kv_heads)
    gate, up, down = (canon[f"{p}.mlp.experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    i = I // tp.size
    sl = slice(tp.rank * i, (tp.rank + 1) * i)
    return {
        f"{p}.self_attn.qkv_proj.weight": np.concatenate(
            [
                q[tp.rank * qs : (tp.rank + 1) * qs],
                k[kv_rank * ks : (kv_rank + 1) * ks],
                v[kv_rank * ks : (kv_rank + 1) * ks],
            ]
        ),
        f"{p}.mlp.experts.routed_experts.w13_weight": np.concatenate([gate[:, sl], up[:, sl]], axis=1),
        f"{p}.mlp.experts.routed_experts.w2_weight": down[:, :, sl],
    }


@pytest.mark.parametrize(("tp_size", "kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 4)])
def test_every_rank_holds_what_vllm_loads(tp_size: int, kv_heads: int) -> None:
    for rank in range(tp_size):
        tp = TP(tp_size, rank)
        catalog = build_catalog(layer_specs(tp, kv_heads=kv_heads))
        canon = canonical_arrays(catalog)
        got = simulate(catalog, canon)
        for name, want in vllm_rank_view(canon, tp, kv_heads).items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"{name} tp={tp}")
        assert not any(np.isnan(a).any() for a in got.values())


def test_replicated_kv_heads_are_registered_on_every_rank_that_holds_them() -> None:
    """kv heads < TP: ranks 0,1 hold kv head 0 and ranks 2,3 kv head 1 (vLLM's replication)."""
    k = "model.layers.0.self_attn.k_proj.weight"
    boxes = []
    for rank in range(4):
        qkv = build_catalog(layer_specs(TP(4, rank), kv_heads=2)).tensors[1]
        boxes.append([p.canon for p in qkv.pieces if p.canonical == k])
    assert boxes[0] == boxes[1] == [Box((0, 0), (D, H))]
    assert boxes[2] == boxes[3] == [Box((D, 0), (2 * D, H))]


def test_vocab_padding_rows_are_not_in_the_catalog() -> None:
    """A padded vocab shard registers only its real rows; the padded tail belongs to no tensor."""
    catalog = build_catalog(
        layer_specs(TP(2, 1), vocab_rows=(32, V)), expected_shapes={"model.embed_tokens.weight": (32, H)}
    )  # V_pad/tp = 32 rows
    embed = catalog.tensors[0]
    assert embed.shape == (V - 32, H)
    assert [p.canon for p in embed.pieces] == [Box((32, 0), (V, H))]


def test_rank_without_real_vocab_rows_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=re.escape("model.embed_tokens.weight: this rank holds no real vocab rows")
    ):
        build_catalog(layer_specs(TP(2, 1), vocab_rows=(40, 40)))


def test_shape_disagreeing_with_vllm_names_the_parameter() -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=f"parameter {name}: layout gives shape"):
        build_catalog(layer_specs(TP(2, 0)), expected_shapes={name: (H, 4 * D)})


def test_indivisible_heads_name_the_parameter() -> None:
    with pytest.raises(ValueError, match=re.escape("qkv_proj.weight: 4 query heads do not split over tp=3")):
        build_catalog(layer_specs(TP(3, 0)))


def test_catalog_json_round_trip_keeps_the_hash() -> None:
    catalog = build_catalog(layer_specs(TP(2, 1)))
    again = catalog_from_json(catalog_to_json(catalog))
    assert again == catalog and again.content_hash == catalog.content_hash


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_staging_feeds_loaders_full_shape_tensors_whose_rank_region_is_exact(tp_size: int) -> None:
    """hf_weights() yields HF names and full HF shapes; the region a loader narrows to is the
    canonical data, whatever rank this is."""
    for rank in range(tp_size):
        catalog = build_catalog(layer_specs(TP(tp_size, rank)))
        canon = canonical_arrays(catalog, seed=rank)
        staging = Staging(catalog)
        staging.begin("r")
        for name, a in canon.items():
            staging.fill_canonical(name, Box.full(a.shape), torch.from_numpy(a))
        staging.require_complete()
        fed = dict(staging.hf_weights())
        experts = "model.layers.0.mlp.experts"
        assert fed[f"{experts}.3.gate_proj.weight"].shape == (I, H)
        for p in (p for t in catalog.tensors for p in t.pieces):
            if p.canonical.startswith(experts):
                proj = p.canonical.split(".")[-2]
                for e in range(p.canon.start[0], p.canon.stop[0]):
                    got = fed[f"{experts}.{e}.{proj}.weight"][p.canon.slices()[1:]]
                    np.testing.assert_array_equal(got.numpy(), canon[p.canonical][e][p.canon.slices()[1:]])
            else:
                assert tuple(fed[p.canonical].shape) == canon[p.canonical].shape
                np.testing.assert_array_equal(
                    fed[p.canonical][p.canon.slices()].numpy(), canon[p.canonical][p.canon.slices()]
                )


def test_incomplete_staging_names_the_missing_tensor() -> None:
    catalog = build_catalog(layer_specs(TP(2, 0)))
    staging = Staging(catalog)
    staging.begin("r7")
    for name, a in canonical_arrays(catalog).items():
        if not name.endswith("v_proj.weight"):
            staging.fill_canonical(name, Box.full(a.shape), torch.from_numpy(a))
    with pytest.raises(
        ValueError, match=r"refit r7: staging incomplete: model.layers.0.self_attn.qkv_proj.weight"
    ):
        staging.require_complete()


def test_a_parameter_without_layout_rule_is_an_error_naming_it() -> None:
    pytest.importorskip("vllm")
    from generator_svc.worker.vllm_layout import param_specs

    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.score = torch.nn.Linear(4, 2, bias=False)  # not a vLLM layer: nothing says how it is sharded
    with pytest.raises(
        ValueError, match=re.escape("parameter score.weight: no layout rule for layer type Linear")
    ):
        param_specs(model)


def test_expert_parallel_ranks_hold_their_experts_whole_and_together_every_expert_once() -> None:
    E, I, H, ranks = 8, 6, 4, 2
    prefix = "model.layers.0.mlp.experts"
    held = np.zeros((E, I, H), dtype=int)
    for rank in range(ranks):
        first, count = rank * E // ranks, E // ranks
        spec = ExpertsParam(
            f"{prefix}.routed_experts.w13_weight",
            "float32",
            "w13",
            prefix,
            E,
            I,
            H,
            TP(1, 0),
            local_experts=(first, count),
        )
        [w13] = build_catalog([spec]).tensors
        assert w13.shape == (count, 2 * I, H)
        for p in w13.pieces:
            if p.canonical == f"{prefix}.gate_proj.weight":
                held[p.canon.slices()] += 1
                assert p.canon.start[0] >= first and p.canon.stop[0] <= first + count
    assert (held == 1).all()


def test_experts_outside_the_layer_are_an_error_naming_the_parameter() -> None:
    spec = ExpertsParam(
        "m.routed_experts.w13_weight", "float32", "w13", "m", 8, 6, 4, TP(1, 0), local_experts=(6, 4)
    )
    with pytest.raises(ValueError, match=re.escape("m.routed_experts.w13_weight: local experts 6..9")):
        build_catalog([spec])
