"""Every parallel layout trains the same model as one process: same losses, same exported weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

LAYOUTS = [  # (pp, dp, ep, tp); all pp, ep, tp in {1, 2}, plus data parallel with expert parallel
    (1, 1, 1, 2), (1, 1, 2, 1), (1, 1, 2, 2), (2, 1, 1, 1),
    (2, 1, 1, 2), (2, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1),
]
RTOL = 1e-5


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
        assert _rel(got[name] - start[name], want[name] - start[name]) <= 1e-3, name
    assert any(not torch.equal(want[n], start[n]) for n in want)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_layout_matches_single_process(run_layout, reference, tiny_dir, layout):
    _assert_same_training(*run_layout(*layout), *reference, tiny_dir)


def test_uneven_token_split_over_tp_matches(run_layout, tiny_dir):
    """15 tokens per microbatch: TP ranks dispatch 8 and 7 tokens (uneven gathers and scatters)."""
    uneven = dict(global_batch_size=2, microbatches=1, seq_len=15)
    _assert_same_training(*run_layout(1, 1, 2, 2, **uneven), *run_layout(1, 1, 1, 1, **uneven), tiny_dir)


def test_reference_loss_is_finite_and_changes(reference):
    ranks, _ = reference
    losses = ranks[0].losses
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert len(set(losses)) == 3
