"""What `attach` refuses, by parameter name, before anything registers."""

from __future__ import annotations

import pytest
import torch
from dtensor_harness import torchrun

from syncd.layout import Canon, Concat
from syncd.member.dtensor import LayoutRefusedError, rank_layout


def test_refusals_name_every_parameter_on_every_rank(tmp_path):
    out = tmp_path / "refusal"
    torchrun("_refusal_ranks.py", str(out))
    texts = [(tmp_path / f"refusal.{r}").read_text() for r in range(4)]
    assert len(set(texts)) == 1, texts  # every rank refuses alike (they agreed first)
    first, second = texts[0].split("\n---\n")
    assert "3 parameter(s) cannot be registered" in first, first
    assert "model.partial.weight: (rank 0) placement P(sum) on mesh dim 0 holds a pending reduction" in first
    assert (
        "model.strided.weight: (rank 0) placement _StridedShard(dim=0, sf=3) on mesh dim 0: "
        "its split factor is not the 1 shard(s)" in first
    )
    assert "encoder.unnamed: (rank 0) no canonical name" in first
    assert "model.renamed.weight" not in first and "q_proj" not in first and "model.norm" not in first
    assert (
        "1 parameter(s)" in second
        and "model.renamed.weight: (rank 0) its name mapping gives a layout of shape (3, 3), "
        "the parameter is (2, 2)"
        in second
    )


def test_a_user_mapping_names_a_fused_parameter():
    qkv = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    names = {
        "layers.0.qkv": Concat(
            0,
            (
                Canon("model.q.weight", (4, 4)),
                Canon("model.k.weight", (3, 4)),
                Canon("model.v.weight", (3, 4)),
            ),
        )
    }
    layout = rank_layout([("layers.0.qkv", qkv)], names=names)
    (tensor,) = layout.catalog.tensors
    assert [(p.canonical, str(p.canon), str(p.local)) for p in tensor.pieces] == [
        ("model.q.weight", "[0:4, 0:4]", "[0:4, 0:4]"),
        ("model.k.weight", "[0:3, 0:4]", "[4:7, 0:4]"),
        ("model.v.weight", "[0:3, 0:4]", "[7:10, 0:4]"),
    ]


def test_builtin_names_group_per_expert_and_fused_experts():
    params = [
        ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.zeros(6, 4)),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(6, 4)),
        ("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(2, 12, 4)),
    ]
    catalog = rank_layout(params).catalog
    shapes = {c.name: c.shape for c in catalog.canonical}
    assert shapes == {
        "model.layers.0.mlp.experts.gate_proj.weight": (2, 6, 4),
        "model.layers.1.mlp.experts.gate_proj.weight": (2, 6, 4),
        "model.layers.1.mlp.experts.up_proj.weight": (2, 6, 4),
    }
    first = catalog.tensors[0].pieces[0]
    assert (str(first.canon), str(first.local)) == ("[1:2, 0:6, 0:4]", "[0:6, 0:4]")


def test_plain_refusal_without_torch_distributed():
    with pytest.raises(LayoutRefusedError, match=r"vision_tower\.proj: no canonical name"):
        rank_layout([("vision_tower.proj", torch.zeros(2))])
