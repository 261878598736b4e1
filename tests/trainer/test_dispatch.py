"""Token dispatch and combine route every (token, k) row to its expert and back, and refuse
inconsistent inputs with clear errors instead of reading out of bounds."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.dispatch import TokenDispatcher

E, K, T, H = 8, 2, 10, 4


def _routing(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def test_rows_reach_their_experts_and_come_back():
    x, idx, w = _routing()
    d = TokenDispatcher(E, None, None)
    rows, per_expert, state = d.dispatch(x, idx)
    assert per_expert.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(E), per_expert)
    y = rows * (expert_of_row + 1).unsqueeze(1)  # expert e scales by e + 1
    out = d.combine(y, w, state)
    expected = ((w * (idx + 1)).sum(1, keepdim=True)) * x
    torch.testing.assert_close(out, expected)


def test_gradients_flow_through_dispatch_and_combine():
    x, idx, w = _routing(1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    d = TokenDispatcher(E, None, None)
    rows, _, state = d.dispatch(x, idx)
    d.combine(rows * 2, w, state).sum().backward()
    torch.testing.assert_close(x.grad, 2 * w.detach().sum(1, keepdim=True).expand(T, H))
    torch.testing.assert_close(w.grad, 2 * x.detach().sum(1, keepdim=True).expand(T, K))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x, idx: (x, idx[:-1]), r"routing indices have shape \(9, 2\), expected \[10, top_k\]"),
        (lambda x, idx: (x, idx + E), r"expert indices must lie in \[0, 8\)"),
        (lambda x, idx: (x, idx - E), r"expert indices must lie in \[0, 8\)"),
        (lambda x, idx: (x, idx.float()), "routing indices must be integers"),
        (lambda x, idx: (x.view(2, T // 2, H), idx), r"tokens must be \[T, H\]"),
    ],
)
def test_dispatch_refuses_inconsistent_routing(make, match):
    x, idx, _ = _routing()
    with pytest.raises(ValueError, match=match):
        TokenDispatcher(E, None, None).dispatch(*make(x, idx))


def test_combine_refuses_mismatched_outputs_and_weights():
    x, idx, w = _routing()
    d = TokenDispatcher(E, None, None)
    rows, _, state = d.dispatch(x, idx)
    with pytest.raises(ValueError, match=r"expert output has shape \(19, 4\), expected \[20, H\]"):
        d.combine(rows[:-1], w, state)
    with pytest.raises(ValueError, match=r"routing weights have shape \(10, 1\), expected \[10, 2\]"):
        d.combine(rows, w[:, :1], state)
