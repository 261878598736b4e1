"""GPipe microbatch schedule over point-to-point send/recv.

All forwards, then all backwards, in microbatch order. Stage s talks only to its counterparts (same
dp, ep, tp) in stages s-1 and s+1, so the chain has no cycle and blocking send/recv cannot
deadlock. Collectives inside a stage (tp, ep) run in the same order on all of its ranks because
every rank of a stage executes the same microbatch sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_svc.data import Microbatch
from trainer_svc.model import Qwen3MoeStage
from trainer_svc.parallel_dims import Mesh
from trainer_svc.precision import Precision


def train_microbatches(
    precision: Precision, mesh: Mesh, microbatches: list[Microbatch], global_tokens: int
) -> torch.Tensor:
    """Run forward and backward of every microbatch in the training precision; gradients
    accumulate in the stage's (float32) parameters. Returns this rank's loss contribution (sum of
    token losses / global_tokens, in float32; 0 off the last stage)."""
    inputs, outputs = [], []
    loss_sum = torch.zeros((), device=microbatches[0].inputs.device)
    stage = precision.model
    assert isinstance(stage, Qwen3MoeStage)  # the pipeline runs stages only
    H = stage.args.hidden_size
    for mb in microbatches:
        if mesh.is_first_stage:
            x = mb.inputs
        else:
            x = torch.empty((*mb.inputs.shape, H), dtype=precision.torch_dtype, device=mb.inputs.device)
            dist.recv(x, src=mesh.stage_peer(-1))
            x.requires_grad_(True)
        y = precision.forward(x)
        if mesh.is_last_stage:
            logits = y.reshape(-1, y.shape[-1]).float()
            y = F.cross_entropy(logits, mb.labels.reshape(-1), reduction="sum") / global_tokens
            loss_sum = loss_sum + y.detach()
        else:
            dist.send(y.detach().contiguous(), dst=mesh.stage_peer(1))
        inputs.append(x)
        outputs.append(y)
    for x, y in zip(inputs, outputs):
        if mesh.is_last_stage:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, src=mesh.stage_peer(1))
            y.backward(grad)
        if not mesh.is_first_stage:
            assert x.grad is not None  # x requires grad (set where it was received)
            dist.send(x.grad.contiguous(), dst=mesh.stage_peer(-1))
    return loss_sum
