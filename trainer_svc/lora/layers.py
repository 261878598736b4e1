"""The LoRA forms of the trainer's target modules. Each keeps the base parameter under its own name
(`q_proj.weight`, `experts.gate_up_proj`: the catalog, exports and loads see the same names) and
adds its adapter's factors next to it, in local (sharded) shapes:

- `LoraLinear` (q/k/v/o_proj): `lora_A [r, in_l]`, `lora_B [out_l, r]`; y = x W^T + s (x A^T) B^T.
- `LoraGroupedExperts`: `gate_up_proj_lora_A [E_l, 2, r, H]`, `gate_up_proj_lora_B [E_l, 2, I_l, r]`,
  `down_proj_lora_A [E_l, r, I_l]`, `down_proj_lora_B [E_l, H, r]`; one adapter per expert and
  projection.

The forward takes the low-rank path (never W + s B A), so training costs r-wide matmuls. How the
factors are placed over (ep, tp), and so which gradients are summed where, is `sharding.PLAN`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer_svc.moe import GroupedExperts


class LoraLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, rank: int, scale: float) -> None:
        super().__init__()
        self.weight = weight
        out_l, in_l = weight.shape
        self.lora_A = nn.Parameter(torch.zeros(rank, in_l))
        self.lora_B = nn.Parameter(torch.zeros(out_l, rank))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)


class LoraGroupedExperts(GroupedExperts):
    def __init__(self, base: GroupedExperts, rank: int, scale: float) -> None:
        nn.Module.__init__(self)
        self.local_experts, self.local_inter = base.local_experts, base.local_inter
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        E, I, H = self.local_experts, self.local_inter, self.gate_up_proj.shape[-1]
        self.gate_up_proj_lora_A = nn.Parameter(torch.zeros(E, 2, rank, H))
        self.gate_up_proj_lora_B = nn.Parameter(torch.zeros(E, 2, I, rank))
        self.down_proj_lora_A = nn.Parameter(torch.zeros(E, rank, I))
        self.down_proj_lora_B = nn.Parameter(torch.zeros(E, H, rank))
        self.scale = scale

    def forward(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        w_E2IH = self.gate_up_proj.view(self.local_experts, 2, self.local_inter, -1)
        a, b = self.gate_up_proj_lora_A, self.gate_up_proj_lora_B
        s = self.scale
        outs = []
        for e, x_nH in enumerate(x_NH.split(rows_per_expert.tolist())):
            gate_nI = x_nH @ w_E2IH[e, 0].t() + s * (x_nH @ a[e, 0].t()) @ b[e, 0].t()
            up_nI = x_nH @ w_E2IH[e, 1].t() + s * (x_nH @ a[e, 1].t()) @ b[e, 1].t()
            h_nI = F.silu(gate_nI) * up_nI
            down = h_nI @ self.down_proj[e].t()
            outs.append(down + s * (h_nI @ self.down_proj_lora_A[e].t()) @ self.down_proj_lora_B[e].t())
        return torch.cat(outs) if outs else x_NH.new_zeros((0, x_NH.shape[1]))
