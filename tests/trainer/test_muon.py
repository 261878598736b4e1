"""Muon's math and the optimizer on one process: orthogonalization, scaling from the whole
matrix's shape, which parameters Muon takes, and one step checked against a hand computation."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.optim.muon import orthogonalize, update_scale
from trainer_svc.optim.optimizer import MuonWithAdamW, build_optimizer
from trainer_svc.parallel_dims import Mesh
from trainer_svc.parallelize import build_stage
from trainer_svc.settings import TrainSettings
from trainer_svc.shard_cut import load_into


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 96)])
def test_newton_schulz_is_close_to_the_polar_factor(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = orthogonalize(g, steps=5)
    s = torch.linalg.svdvals(x)
    assert x.shape == g.shape
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25  # every direction pushed towards 1
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    cosine = float((x * polar).sum() / (x.norm() * polar.norm()))
    assert cosine > 0.95


def test_orthogonalize_refuses_non_matrices():
    with pytest.raises(ValueError, match=r"2-D matrix, got shape \(2, 3, 4\)"):
        orthogonalize(torch.zeros(2, 3, 4), steps=5)


def test_update_scale_uses_the_whole_shape():
    assert update_scale((64, 128)) == pytest.approx(0.2 * 128**0.5)


def test_settings_refuse_an_unknown_optimizer(tiny_dir):
    with pytest.raises(ValueError, match="--optimizer must be adamw or muon, got 'sgd'"):
        TrainSettings(model_dir=tiny_dir, optimizer="sgd")
    with pytest.raises(ValueError, match="--muon-momentum must be in"):
        TrainSettings(model_dir=tiny_dir, optimizer="muon", muon_momentum=1.5)


def _single(tiny_dir, **overrides):
    settings = TrainSettings(model_dir=tiny_dir, optimizer="muon", lr=1e-2, weight_decay=0.1, **overrides)
    args, canonical = load_hf(tiny_dir)
    model = build_stage(args, Mesh.single())
    load_into(model, canonical, Mesh.single().dims, Mesh.single().coords)
    return settings, args, model, canonical


def test_muon_takes_hidden_matrices_and_adamw_the_rest(tiny_dir):
    settings, args, model, _ = _single(tiny_dir)
    opt = build_optimizer(settings, model, Mesh.single(), args)
    muon = set(opt.paths)
    names = {n for n, _ in model.named_parameters()}
    expected_muon = {
        n
        for n in names
        if n.endswith(
            ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_up_proj", "down_proj")
        )
    }
    assert muon == expected_muon
    adamw = set(names - muon)
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_norm.weight",
    } <= adamw
    assert set(opt.paths.values()) == {"local"}


def test_two_steps_update_each_expert_matrix_by_its_own_orthogonalized_momentum(tiny_dir):
    """Expert 3's up matrix, read from the fused gate/up weight, moves exactly as Muon on that
    matrix alone would move it (momentum 0.9, Nesterov, weight decay, global-shape scale)."""
    settings, args, model, canonical = _single(tiny_dir, muon_momentum=0.9)
    opt = MuonWithAdamW(model, Mesh.single(), args, settings)
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    I = args.moe_intermediate_size
    w = canonical["model.layers.1.mlp.experts.up_proj.weight"][3].clone()
    buf = torch.zeros_like(w)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        g = fused.grad.view(args.num_experts, 2, I, -1)[3, 1].clone()
        opt.step()
        buf = 0.9 * buf + g
        expected = orthogonalize(g + 0.9 * buf, 5) * 0.2 * max(w.shape) ** 0.5
        w = w * (1 - settings.lr * settings.weight_decay) - settings.lr * expected
    got = fused.detach().view(args.num_experts, 2, I, -1)[3, 1]
    torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got, canonical["model.layers.1.mlp.experts.up_proj.weight"][3])
