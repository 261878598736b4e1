"""A model's LoRA factors in syncd's names (`syncd.member.adapter_sender.lora_factors`), the
catalog a named adapter's trainer registers, and the rank syncd reads off it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncd.layout.adapters import AdapterSpec, adapter_rank, parse_slot_tensor, slot_catalog, slot_tensor
from syncd.member.adapter_sender import adapter_catalog, lora_factors


class PeftStyleLinear(nn.Module):
    """A linear as PEFT wraps it: `base_layer`, and per named adapter `lora_A.<name>` / `lora_B.<name>`."""

    def __init__(self, inp: int, out: int, rank: int, adapters: tuple[str, ...]) -> None:
        super().__init__()
        self.base_layer = nn.Linear(inp, out, bias=False)
        self.lora_A = nn.ModuleDict({a: nn.Linear(inp, rank, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(rank, out, bias=False) for a in adapters})


def peft_style_model(rank: int = 4, adapters: tuple[str, ...] = ("default",)) -> nn.Module:
    attn = nn.Module()
    attn.q_proj = PeftStyleLinear(8, 16, rank, adapters)
    attn.v_proj = PeftStyleLinear(8, 4, rank, adapters)
    layer = nn.Module()
    layer.self_attn = attn
    inner = nn.Module()
    inner.layers = nn.ModuleList([layer])
    causal_lm = nn.Module()
    causal_lm.model = inner
    lora_model = nn.Module()
    lora_model.model = causal_lm
    peft_model = nn.Module()
    peft_model.base_model = lora_model  # PEFT's PeftModel.base_model.model is the wrapped model
    return peft_model


def test_peft_names_become_syncds_and_the_factors_are_the_live_parameters() -> None:
    model = peft_style_model(rank=4, adapters=("default", "other"))
    factors = lora_factors(model)
    assert sorted(factors) == [
        f"model.layers.0.self_attn.{p}.lora_{f}.weight" for p in ("q_proj", "v_proj") for f in "AB"
    ]
    a = factors["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert (
        a.shape == (4, 8)
        and a.data_ptr()
        == model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.data_ptr()
    )
    assert lora_factors(model, "other")["model.layers.0.self_attn.v_proj.lora_B.weight"].shape == (4, 4)
    plain = nn.Module()  # one adapter's factors as plain parameters, as trainer_svc's LoraLinear holds them
    plain.lora_A, plain.lora_B = nn.Parameter(torch.zeros(4, 8)), nn.Parameter(torch.zeros(16, 4))
    holder = nn.Module()
    holder.q_proj = plain
    assert sorted(lora_factors(holder)) == ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    linear = nn.Module()  # as linears, without adapter names
    linear.lora_A, linear.lora_B = nn.Linear(8, 4, bias=False), nn.Linear(4, 16, bias=False)
    holder.q_proj = linear
    assert sorted(lora_factors(holder)) == ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    catalog = adapter_catalog(factors)
    assert adapter_rank(catalog) == 4
    slots = slot_catalog("policy-a", catalog, "bfloat16")
    assert {parse_slot_tensor(t.name) for t in slots.tensors} == {("policy-a", n) for n in factors}
    assert all(
        t.dtype == "bfloat16" and t.shape == factors[parse_slot_tensor(t.name)[1]].shape
        for t in slots.tensors
    )


def test_what_is_no_adapter_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no LoRA factors of adapter 'missing'"):
        lora_factors(peft_style_model(), "missing")
    odd = adapter_catalog({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"up_proj\.weight \[4, 4\] is no LoRA factor"):
        adapter_rank(odd)
    mixed = adapter_catalog(lora_factors(peft_style_model(rank=4)) | {"x.lora_A.weight": torch.zeros(2, 8)})
    with pytest.raises(ValueError, match="disagree on the rank"):
        adapter_rank(mixed)
    with pytest.raises(ValueError, match="not 1-128 letters"):
        AdapterSpec("policy a", 4, 8.0, ("q_proj",)).validate()
    with pytest.raises(ValueError, match="names no adapter slot tensor"):
        parse_slot_tensor("model.layers.0.self_attn.q_proj.weight")
    assert parse_slot_tensor(slot_tensor("a", "m.lora_A.weight")) == ("a", "m.lora_A.weight")
