"""The trainer's logprobs of given token sequences, and the KL estimate RL users watch.

After a refit, vLLM's logprobs of the tokens it sampled must match the trainer's logprobs of the
same tokens; a wrong fused layout or a torn refit shows up here as a KL far from zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.model import Qwen3MoeStage
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.shard_cut import load_into


class Scorer:
    """A single-process copy of the model at an HF checkpoint (the trainer's export)."""

    def __init__(self, model_dir: str | Path) -> None:
        args, canonical = load_hf(model_dir)
        self.model = Qwen3MoeStage(args, range(args.num_hidden_layers), first=True, last=True)
        load_into(self.model, canonical, ParallelDims(), Coords(0, 0, 0, 0))
        self.model.eval()

    @torch.no_grad()
    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """log p(completion[i] | prompt + completion[:i]) for every i."""
        if not completion:
            return []
        tokens = torch.tensor([list(prompt) + list(completion)])
        logits = self.model(tokens)[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


def kl_estimate(behaviour: Sequence[float], target: Sequence[float]) -> float:
    """KL(behaviour || target) from logprobs of tokens sampled from `behaviour` (the k3
    estimator: mean of e^r - 1 - r with r = target - behaviour; non-negative, low variance)."""
    if len(behaviour) != len(target) or not behaviour:
        raise ValueError(f"need equally many logprobs on both sides, got {len(behaviour)} and {len(target)}")
    return sum(math.exp(t - b) - 1 - (t - b) for b, t in zip(behaviour, target)) / len(behaviour)
