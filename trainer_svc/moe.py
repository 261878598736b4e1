"""The MoE block: softmax top-k router and SiLU-gated experts sharded over ep and tp.

Shape legend: T tokens, H hidden, K experts per token, E experts, E_l local experts (E / ep),
I_l local expert intermediate size (I / tp).

Expert weights are stored as expert-TP shards:
- `gate_up_proj` [E_l * 2 * I_l, H]: the fused column-parallel weight. Row (e, p, i) is row
  tp_rank * I_l + i of projection p (0 gate, 1 up) of expert e: every TP rank keeps the same slice
  of every (expert, projection) pair, which is InterleavedShard(0, stripes=E_l * 2) of the
  concatenation [gate_0; up_0; gate_1; up_1; ...]. Viewed as [E_l, 2, I_l, H].
- `down_proj` [E_l, H, I_l]: row-parallel, its partial sums are reduced inside combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer_svc import comm
from trainer_svc.config import ModelArgs
from trainer_svc.dispatch import TokenDispatcher


class Router(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (routing weights [T, K], expert indices [T, K])."""
        probs_TE = F.softmax(F.linear(x_TH, self.weight), dim=-1, dtype=torch.float32)
        top_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return top_TK.to(x_TH.dtype), idx_TK


class GroupedExperts(nn.Module):
    def __init__(self, args: ModelArgs, ep: int, tp: int) -> None:
        super().__init__()
        self.local_experts = args.num_experts // ep
        self.local_inter = args.moe_intermediate_size // tp
        H = args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts * 2 * self.local_inter, H))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, H, self.local_inter))

    def forward(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert -> partial outputs (sum over tp for the full result)."""
        w_E2IH = self.gate_up_proj.view(self.local_experts, 2, self.local_inter, -1)
        outs = []
        for e, x_nH in enumerate(x_NH.split(rows_per_expert.tolist())):
            gate_nI = x_nH @ w_E2IH[e, 0].t()
            up_nI = x_nH @ w_E2IH[e, 1].t()
            outs.append((F.silu(gate_nI) * up_nI) @ self.down_proj[e].t())
        return torch.cat(outs) if outs else x_NH.new_zeros((0, x_NH.shape[1]))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, ep_group: comm.Group, tp_group: comm.Group) -> None:
        super().__init__()
        self.gate = Router(args)
        self.experts = GroupedExperts(args, comm.group_size(ep_group), comm.group_size(tp_group))
        self.dispatcher = TokenDispatcher(args.num_experts, ep_group, tp_group)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights_TK, idx_TK = self.gate(x_TH)
        rows_NH, per_expert, state = self.dispatcher.dispatch(x_TH, idx_TK)
        y_NH = self.experts(rows_NH, per_expert)
        return self.dispatcher.combine(y_NH, weights_TK, state).view_as(x_BSH)
