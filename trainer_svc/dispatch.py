"""Token dispatch and combine for expert-TP MoE: all-to-all over ep, with the TP traffic inside.

Shape legend: T tokens held (replicated) by this TP group, T_l = my TP block of them, K experts
per token, E experts, E_l = E / ep local experts, H hidden, R rows received over ep, N rows
gathered over tp (the input of my local experts).

dispatch: every TP rank routes only its block of the (replicated) tokens (no duplicate traffic),
sends each (token, k) row to the ep rank owning expert idx over the ep group, then all-gathers
the received rows over tp, because each TP rank holds a slice of every local expert and must see
every row. combine reverses it: the row-parallel down projection leaves partial sums, which a
reduce-scatter over tp both sums and hands back to the TP rank that dispatched them; an all-to-all
returns them to their tokens, the routing weights are applied, and an all-gather over tp makes
the output replicated again. Every step has an autograd backward (see comm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncd.layout import split_range
from trainer_svc import comm


@dataclass(frozen=True)
class DispatchState:
    """What combine needs to route rows back; produced by `TokenDispatcher.dispatch`."""

    num_tokens: int  # T
    top_k: int  # K
    token_sizes: list[int]  # T_l of every TP rank
    order: torch.Tensor  # [T_l*K] my (token, k) rows sorted by expert
    ep_send: list[int]  # rows sent to each ep rank
    ep_recv: list[int]  # rows received from each ep rank
    tp_rows: list[int]  # R of every TP rank
    perm: torch.Tensor  # [N] gathered rows sorted by local expert

    @property
    def num_rows(self) -> int:
        return int(self.perm.numel())


class TokenDispatcher:
    def __init__(self, num_experts: int, ep_group: comm.Group, tp_group: comm.Group) -> None:
        self.num_experts = num_experts
        self.ep_group, self.tp_group = ep_group, tp_group
        self.ep = comm.group_size(ep_group)
        self.tp = comm.group_size(tp_group)
        self.local_experts = num_experts // self.ep

    def dispatch(
        self, x_TH: torch.Tensor, idx_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Returns (rows for my local experts grouped by expert [N, H], rows per expert [E_l], state)."""
        self._check_routing(x_TH, idx_TK)
        T, K = idx_TK.shape
        token_sizes = [b - a for a, b in (split_range(T, self.tp, j) for j in range(self.tp))]
        lo, hi = split_range(T, self.tp, comm.group_rank(self.tp_group))
        x_lH = comm.split_rows(x_TH, token_sizes, self.tp_group)
        flat = idx_TK[lo:hi].reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x_lH.index_select(0, torch.div(order, K, rounding_mode="floor"))
        counts_E = torch.bincount(flat, minlength=self.num_experts)

        E_l = self.local_experts
        per_peer = [E_l] * self.ep
        recv_counts = comm.all_to_all_rows(counts_E, per_peer, per_peer, self.ep_group)
        ep_send = counts_E.view(self.ep, E_l).sum(1).tolist()
        ep_recv = recv_counts.view(self.ep, E_l).sum(1).tolist()
        got_RH = comm.all_to_all(rows, ep_send, ep_recv, self.ep_group)

        tp_rows = comm.all_gather_sizes(got_RH.shape[0], self.tp_group, x_TH.device)
        counts_all = comm.all_gather_rows(recv_counts.view(1, -1), [1] * self.tp, self.tp_group)
        rows_NH = comm.gather_rows_for_sharded_use(got_RH, tp_rows, self.tp_group)
        experts = torch.arange(E_l, device=x_TH.device).repeat(self.tp * self.ep)
        expert_of_row = torch.repeat_interleave(experts, counts_all.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        per_expert = counts_all.view(self.tp * self.ep, E_l).sum(0)
        state = DispatchState(T, K, token_sizes, order, ep_send, ep_recv, tp_rows, perm)
        return rows_NH.index_select(0, perm), per_expert, state

    def combine(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Partial expert outputs [N, H] (sorted as dispatch returned them) -> tokens [T, H]."""
        if y_NH.dim() != 2 or y_NH.shape[0] != state.num_rows:
            raise ValueError(
                f"combine: expert output has shape {tuple(y_NH.shape)}, expected [{state.num_rows}, H] "
                "(the rows dispatch returned)"
            )
        if tuple(weights_TK.shape) != (state.num_tokens, state.top_k):
            raise ValueError(
                f"combine: routing weights have shape {tuple(weights_TK.shape)}, expected "
                f"[{state.num_tokens}, {state.top_k}] (tokens, top_k of dispatch)"
            )
        rows = y_NH.index_select(0, torch.argsort(state.perm))
        rows = comm.reduce_scatter_rows(rows, state.tp_rows, self.tp_group)
        rows = comm.all_to_all(rows, state.ep_recv, state.ep_send, self.ep_group)
        T_l = state.token_sizes[comm.group_rank(self.tp_group)]
        rows_lKH = rows.index_select(0, torch.argsort(state.order)).view(T_l, state.top_k, -1)
        w_lK = comm.split_rows(weights_TK, state.token_sizes, self.tp_group)
        out_lH = (rows_lKH * w_lK.unsqueeze(-1).to(rows_lKH.dtype)).sum(1)
        return comm.gather_rows_replicated(out_lH, state.token_sizes, self.tp_group)

    def _check_routing(self, x_TH: torch.Tensor, idx_TK: torch.Tensor) -> None:
        if x_TH.dim() != 2:
            raise ValueError(f"dispatch: tokens must be [T, H], got shape {tuple(x_TH.shape)}")
        if idx_TK.dim() != 2 or idx_TK.shape[0] != x_TH.shape[0]:
            raise ValueError(
                f"dispatch: routing indices have shape {tuple(idx_TK.shape)}, expected "
                f"[{x_TH.shape[0]}, top_k] (one row per token)"
            )
        if idx_TK.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"dispatch: routing indices must be integers, got {idx_TK.dtype}")
        if idx_TK.numel() and (int(idx_TK.min()) < 0 or int(idx_TK.max()) >= self.num_experts):
            raise ValueError(
                f"dispatch: expert indices must lie in [0, {self.num_experts}), got "
                f"[{int(idx_TK.min())}, {int(idx_TK.max())}]"
            )
