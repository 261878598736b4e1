"""Every parallel layout trains the same model as one process: same losses, same exported weights,
in float32 to 1e-5 and in bfloat16 (float32 masters) to the bfloat16 tolerances below."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

LAYOUTS = [  # (pp, dp, ep, tp); all pp, ep, tp in {1, 2}, plus data parallel with expert parallel
    (1, 1, 1, 2),
    (1, 1, 2, 1),
    (1, 1, 2, 2),
    (2, 1, 1, 1),
    (2, 1, 1, 2),
    (2, 1, 2, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 1),
]
RTOL = 1e-5
# An update (end weights minus start) is a small difference of large weights, so the 1e-5 of the
# weights grows in it: measured worst 1.03e-3 relative (layer 1's q_proj, 15 tokens split 8/7 over
# TP, torch 2.13 on CPU). A wrong layout (a shard lost, a gradient doubled) moves it by O(1).
UPDATE_RTOL = 3e-3
# bfloat16 compute (8 significand bits): layouts sum in other orders, so the loss moves in its 4th
# digit (measured 6e-5 relative) and an exported weight may round one bf16 ulp (2^-8) the other
# way (measured worst tensor 4.8e-3 relative).
BF16_LAYOUTS = [(1, 1, 2, 2), (2, 1, 2, 1)]  # (pp, dp, ep, tp): the e2e layouts (1,2,2) and (2,2,1)
BF16_LOSS_RTOL, BF16_WEIGHT_RTOL = 1e-3, 1e-2


@pytest.fixture(scope="session")
def reference(run_layout):
    return run_layout(1, 1, 1, 1)


def _assert_same_training(ranks, export, ref_ranks, ref_export, start_dir) -> None:
    expected_losses = torch.tensor(ref_ranks[0].losses)
    for r in ranks:  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(r.losses), expected_losses, rtol=RTOL, atol=0)
    got, want = load_file(str(export / "model.safetensors")), load_file(str(ref_export / "model.safetensors"))
    start = load_file(f"{start_dir}/model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert _rel(got[name], want[name]) <= RTOL, name
        # the update itself (not just the weights) agrees, so a wrong layout cannot hide in it
        assert _rel(got[name] - start[name], want[name] - start[name]) <= UPDATE_RTOL, name
    assert any(not torch.equal(want[n], start[n]) for n in want)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_layout_matches_single_process(run_layout, reference, tiny_dir, layout):
    _assert_same_training(*run_layout(*layout), *reference, tiny_dir)


def test_uneven_token_split_over_tp_matches(run_layout, tiny_dir):
    """15 tokens per microbatch: TP ranks dispatch 8 and 7 tokens (uneven gathers and scatters)."""
    uneven = {"global_batch_size": 2, "microbatches": 1, "seq_len": 15}
    _assert_same_training(*run_layout(1, 1, 2, 2, **uneven), *run_layout(1, 1, 1, 1, **uneven), tiny_dir)


def test_reference_loss_is_finite_and_changes(reference):
    ranks, _ = reference
    losses = ranks[0].losses
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert len(set(losses)) == 3


@pytest.fixture(scope="session")
def bf16_reference(run_layout):
    return run_layout(1, 1, 1, 1, dtype="bfloat16")


@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_bf16_layout_matches_single_process(run_layout, bf16_reference, layout):
    ranks, export = run_layout(*layout, dtype="bfloat16")
    ref_ranks, ref_export = bf16_reference
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r.losses), torch.tensor(ref_ranks[0].losses), rtol=BF16_LOSS_RTOL, atol=0
        )
    got, want = load_file(str(export / "model.safetensors")), load_file(str(ref_export / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert _rel(got[name].float(), want[name].float()) <= BF16_WEIGHT_RTOL, name


def test_bf16_keeps_float32_masters_and_exports_the_bf16_weights_it_computes_with(
    bf16_reference, reference, tiny_dir
):
    ranks, export = bf16_reference
    masters = ranks[0].params
    got = load_file(str(export / "model.safetensors"))
    start = load_file(f"{tiny_dir}/model.safetensors")
    assert all(m.dtype == torch.float32 for m in masters.values())
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ):
        assert torch.equal(got[name], masters[name].to(torch.bfloat16)), name
    # Updates smaller than a bf16 ulp still accumulate in the masters (lr 1e-4 on weights ~0.02).
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(masters[name], start[name].float())
    # bfloat16 compute trains the float32 model: the same losses to the bfloat16 tolerance.
    torch.testing.assert_close(
        torch.tensor(ranks[0].losses), torch.tensor(reference[0][0].losses), rtol=BF16_LOSS_RTOL, atol=0
    )


LORA = {"lora_rank": 4}


@pytest.mark.parametrize("layout", [(1, 1, 2, 2), (1, 2, 1, 2)], ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_lora_adapters_train_alike_on_every_layout_over_a_frozen_base(run_layout, tiny_dir, layout):
    """LoRA factors sharded like the weights they adapt (tp-partial gradients summed over tp, expert
    factors over ep): the same losses and, reassembled from every rank's shards, the same adapter
    as one process trains; the base stays as loaded, the merged targets are what change."""
    from syncd.layout.hf_names import group_from_hf
    from trainer_svc.lora.checkpoint import load_adapter

    ranks, export = run_layout(*layout, **LORA)
    ref_ranks, ref_export = run_layout(1, 1, 1, 1, **LORA)
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r.losses), torch.tensor(ref_ranks[0].losses), rtol=RTOL, atol=0
        )
    got, want = load_adapter(export), load_adapter(ref_export)
    assert sorted(got.tensors) == sorted(want.tensors) and want.targets()
    for name, factor in want.tensors.items():
        assert _rel(got.tensors[name], factor) <= UPDATE_RTOL, name
    merged, start = (
        group_from_hf(load_file(path).items(), torch.stack)
        for path in (str(export / "model.safetensors"), f"{tiny_dir}/model.safetensors")
    )
    changed = {n for n in start if not torch.equal(merged[n], start[n])}
    assert changed == set(want.targets())
