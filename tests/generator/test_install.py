"""The copies of the install by parameter (no vLLM needed): what lands in a parameter, and the
errors for buffers that do not fit. The install inside vLLM is checked against vLLM's own loader
in test_generator_coverage.py."""

from __future__ import annotations

import pytest
import torch

from generator_svc.worker.install import copy_into, copy_parameters, params_by_layer


def test_a_vocab_shard_gets_the_staged_rows_and_zero_padding() -> None:
    param = torch.full((6, 4), 7.0)  # 4 real rows + 2 padded rows, as vLLM allocates a vocab shard
    staged = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    copy_into(param, staged)
    assert torch.equal(param[:4], staged)
    assert not param[4:].any()


def test_a_buffer_that_does_not_fit_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"staged shape \(4, 3\) does not fit parameter shape \(6, 4\)"):
        copy_into(torch.zeros(6, 4), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"staged shape \(8, 4\) does not fit parameter shape \(6, 4\)"):
        copy_into(torch.zeros(6, 4), torch.zeros(8, 4))


def test_copy_parameters_installs_every_parameter_bit_exactly_and_counts_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    buffers = {
        "a.qkv_proj.weight": torch.randn(12, 8, generator=gen).to(torch.bfloat16),
        "a.experts.w13_weight": torch.randn(4, 6, 8, generator=gen).to(torch.bfloat16),
    }
    params = {n: torch.zeros_like(b) for n, b in buffers.items()}
    assert copy_parameters(params, buffers) == (12 * 8 + 4 * 6 * 8) * 2
    for name in buffers:
        assert torch.equal(params[name], buffers[name]), name


def test_parameters_are_grouped_by_their_layer_in_order() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "model.layers.0.mlp.experts.routed_experts.w2_weight",
        "model.norm.weight",
    ]
    assert params_by_layer(names) == {
        "model.embed_tokens": ["model.embed_tokens.weight"],
        "model.layers.0.mlp.experts.routed_experts": names[1:3],
        "model.norm": ["model.norm.weight"],
    }
