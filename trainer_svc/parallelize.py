"""The recipe that turns (model args, mesh) into this rank's pipeline stage and its grad sync.

Order matters: the stage is built with the TP/EP groups already inside its modules (local shapes,
collectives in the forward), then filled from canonical tensors, and only then is the gradient
sync plan derived from parameter names, because which group a gradient is reduced over depends
on how that parameter is sharded:

- experts (`gate_up_proj`, `down_proj`): sharded over ep and tp, replicated over dp -> sum over dp.
- q_norm / k_norm: replicated over tp, but each TP rank sees only its own heads, so their
  gradients are partial over tp -> sum over tp, then over dp x ep.
- everything else: identical on TP peers by the comm.py convention -> sum over dp x ep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncd.layout import split_range
from trainer_svc import comm
from trainer_svc.config import ModelArgs
from trainer_svc.model import Qwen3MoeStage
from trainer_svc.parallel_dims import Mesh

EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")
TP_SHARDED_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
TP_PARTIAL_SUFFIXES = ("q_norm.weight", "k_norm.weight")


def stage_layers(args: ModelArgs, pp: int, stage: int) -> range:
    """Contiguous layers of a stage; earlier stages get the extra layer of an uneven split."""
    return range(*split_range(args.num_hidden_layers, pp, stage))


def build_stage(args: ModelArgs, mesh: Mesh) -> Qwen3MoeStage:
    return Qwen3MoeStage(
        args,
        stage_layers(args, mesh.dims.pp, mesh.coords.pp),
        first=mesh.is_first_stage,
        last=mesh.is_last_stage,
        ep_group=mesh.ep,
        tp_group=mesh.tp,
    )


@dataclass(frozen=True)
class GradSync:
    """How one parameter's gradient is made whole: groups to sum over, in order, and how many
    ranks then hold an identical copy (so a global norm counts every element once)."""

    param: torch.nn.Parameter
    groups: tuple[comm.Group, ...]
    replicas: int


def grad_sync_plan(model: Qwen3MoeStage, mesh: Mesh) -> list[GradSync]:
    d = mesh.dims
    plan = []
    for name, p in model.named_parameters():
        if name.endswith(EXPERT_SUFFIXES):
            plan.append(GradSync(p, (mesh.dp,), d.dp))
        elif name.endswith(TP_SHARDED_SUFFIXES):
            plan.append(GradSync(p, (mesh.dp_ep,), d.dp * d.ep))
        elif name.endswith(TP_PARTIAL_SUFFIXES):
            plan.append(GradSync(p, (mesh.tp, mesh.dp_ep), d.dp * d.ep * d.tp))
        else:
            plan.append(GradSync(p, (mesh.dp_ep,), d.dp * d.ep * d.tp))
    return plan


@torch.no_grad()
def sync_grads(plan: list[GradSync]) -> None:
    """Sum gradients over their groups (losses are pre-divided by the global token count)."""
    for item in plan:
        if item.param.grad is None:
            item.param.grad = torch.zeros_like(item.param)
        for group in item.groups:
            if comm.group_size(group) > 1:
                dist.all_reduce(item.param.grad, group=group)


@torch.no_grad()
def global_grad_norm(plan: list[GradSync], world: bool) -> float:
    """L2 norm of the whole model's gradient (collective over the world when `world`)."""
    dev = plan[0].param.device
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for item in plan:
        total += item.param.grad.double().pow(2).sum() / item.replicas
    if world:
        dist.all_reduce(total)
    return float(total.sqrt())
