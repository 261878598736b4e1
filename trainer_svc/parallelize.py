"""The recipe that turns (model args, mesh) into this rank's pipeline stage and its grad sync.

Order matters: the stage is built with the TP/EP groups already inside its modules (local shapes,
collectives in the forward), then filled from canonical tensors, and only then is the gradient
sync plan derived from each parameter's placement (`sharding.PLAN`), because which group a
gradient is reduced over depends on how that parameter is sharded:

- sharded over ep (experts): replicated over dp only -> sum over dp.
- partial over tp (q_norm / k_norm): replicated over tp, but each TP rank sees only its own heads
  -> sum over tp, then over dp x ep.
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
from trainer_svc.sharding import sharding_of


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
        if not p.requires_grad:
            continue  # frozen (a LoRA run's base): no gradient to sync
        s = sharding_of(name)
        replicated_over = (mesh.dp_ep,) if s.ep_dim is None else (mesh.dp,)
        groups = ((mesh.tp,) if s.tp_partial_grad else ()) + replicated_over
        replicas = d.dp * (d.ep if s.ep_dim is None else 1) * (d.tp if s.tp_dim is None else 1)
        plan.append(GradSync(p, groups, replicas))
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
        grad = item.param.grad
        assert grad is not None  # sync_grads gave every parameter one
        total += grad.double().pow(2).sum() / item.replicas
    if world:
        dist.all_reduce(total)
    return float(total.sqrt())
